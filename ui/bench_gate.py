"""What both Benchmark tabs (the local engine's and a model server's) share: the run button
for the admin only, and the page's sizes read as whole numbers. No torch here: the tab of a
front end for a model server (--backend) uses it too."""

from __future__ import annotations

import gradio as gr

from server.common import user_error


def whole_number(value, what: str) -> int:
    """A size as the page sends it (a number, the checkboxes' strings), or a plain refusal:
    12.5 tokens are not rounded to 12. The ranges are checked by bench_loaded (LOADED_LIMITS)."""
    if isinstance(value, str) and value.isascii() and value.strip().isdigit() \
            and len(value) <= 18:
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise user_error(f"{what} must be a whole number (got {str(value)[:40]!r})")
    return value


def admin_only(demo: gr.Blocks | None, admin: str | None, button, note) -> None:
    """Under --admin, each page load enables `button` for the admin only and says why in
    `note` (the handler checks too: this is the courtesy)."""
    if demo is None or admin is None:
        return

    def for_user(request: gr.Request):
        user = getattr(request, "username", None)
        return gr.update(interactive=user == admin), admin_note(admin, user)

    demo.load(for_user, None, [button, note], api_visibility="private", show_progress="hidden")


def admin_note(admin: str | None, user: str | None) -> str:
    if admin is None or user == admin:
        return ""
    return (f"Only the admin user (**{admin}**) may run the benchmark: it holds the engine "
            "that serves every chat.")
