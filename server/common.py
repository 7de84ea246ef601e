"""Small pieces every panel needs: user-facing errors, the admin check, app-wide notices."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import gradio as gr

log = logging.getLogger("ui")

DEMO_NOTICE = "tiny demo model: it knows only about fifty questions about this app"
STARTUP_FAILED = "**The start-up model did not load:**"


def user_error(message: str) -> gr.Error:
    """A gr.Error for bad input: shown to the user (and to API clients as an error status).

    gradio renders error text as HTML and messages may quote what the user typed (a path, a
    hub id), so "<" and "&" are escaped; ">" cannot open markup and stays readable (">= 0").
    No traceback on the console: the input was wrong, not the code.
    """
    text = str(message).replace("&", "&amp;").replace("<", "&lt;")
    return gr.Error(text, print_exception=False)


def reply_concurrency(engine) -> int:
    """How many chat handlers may run at once: every reply the engine decodes together plus
    every one it lets wait. Past that the engine itself says "busy" (errors.QueueFull)."""
    return engine.max_batch + engine.max_queue


def require_admin(admin: str | None, request: gr.Request | None, action: str) -> None:
    """Raise unless this request may change the loaded model.

    Checked inside every handler that loads or unloads, so an API call or a crafted request
    is refused the same way as a click; hiding buttons would protect nothing.
    """
    if admin is None:
        return
    user = getattr(request, "username", None)
    if user != admin:
        log.warning("refused %s for user %r: only %r may change the model", action, user, admin)
        raise user_error(f"only the admin user ({admin}) may {action}; you are "
                         f"{'not logged in' if user is None else repr(user)}")


@dataclass
class AppInfo:
    """What app.py learns at start-up and the page shows: written once before or right after
    launch, read on every page load (so a failed share tunnel can still be reported)."""

    startup_error: str = ""
    share_note: str = ""

    def follow(self, status: dict) -> None:
        """Told the engine's status as pages see it: once a model is loaded (from any page,
        the API or a training run) the start-up load's failure is over, and its notice goes
        from every page, for good (a later unload does not bring the old failure back)."""
        if status.get("loaded"):
            self.startup_error = ""

    def startup_message(self) -> str:
        if not self.startup_error:
            return ""
        return f"{STARTUP_FAILED} {self.startup_error}"

    def banner(self) -> str:
        lines = []
        if self.share_note:
            lines.append(f"**Sharing:** {self.share_note}")
        if self.startup_error:
            lines.append(self.startup_message())
        return "\n\n".join(lines)
