"""Where gradio keeps uploaded files, and how large they may be.

gradio's default is one folder under the system temp dir, shared by every app and user of the
machine, readable by all of them, kept after the server ends, and with no size limit. This app
gives gradio a folder of its own, private to the server's user (mode 0700), removed at
shutdown, and caps each upload. Set GRADIO_TEMP_DIR to choose the folder yourself (then it is
left as it is at shutdown).

Must run before gradio is imported: gradio reads GRADIO_TEMP_DIR when it loads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

MAX_UPLOAD_MB = 100  # a training data file; a conversation import is capped lower (5 MB)
MAX_UPLOAD = f"{MAX_UPLOAD_MB}mb"  # gradio's launch(max_file_size=...)


def private_upload_dir() -> Path | None:
    """The folder made for this server's uploads (None: the operator's GRADIO_TEMP_DIR)."""
    if os.environ.get("GRADIO_TEMP_DIR"):
        return None
    folder = Path(tempfile.mkdtemp(prefix="qwen-chat-uploads-"))  # mkdtemp: mode 0700
    os.environ["GRADIO_TEMP_DIR"] = str(folder)
    return folder


def remove_upload_dir(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
