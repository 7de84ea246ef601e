"""A change event of a gr.BrowserState that fires once per change of its content.

A BrowserState dispatches `change` whenever its value is another object, and the page hands
it a new, equal copy again around the events it takes part in. The conversation's listeners
(the chat list's write, the branch pager, the context budget) take part in such events
themselves, so each change they ran on brought another: on an idle page the conversation
kept "changing" several times a second, and each time the context budget was counted with
whatever the message box held, the typing pause it waits for notwithstanding.

A step in the browser writes a fingerprint of the value into a hidden textbox, whose `change`
fires only when its text differs: listen to that one, and read the BrowserState itself.
"""

from __future__ import annotations

import gradio as gr

# The length of the value's JSON and its 53-bit cyrb53 hash: two different conversations of
# one page with the same fingerprint are out of reach.
_FINGERPRINT = """(value) => {
    const text = JSON.stringify(value ?? null);
    let h1 = 0xdeadbeef, h2 = 0x41c6ce57;
    for (let i = 0; i < text.length; i++) {
        const ch = text.charCodeAt(i);
        h1 = Math.imul(h1 ^ ch, 2654435761);
        h2 = Math.imul(h2 ^ ch, 1597334677);
    }
    h1 = Math.imul(h1 ^ (h1 >>> 16), 2246822507);
    h1 ^= Math.imul(h2 ^ (h2 >>> 13), 3266489909);
    h2 = Math.imul(h2 ^ (h2 >>> 16), 2246822507);
    h2 ^= Math.imul(h1 ^ (h1 >>> 13), 3266489909);
    return `${text.length}:${4294967296 * (2097151 & h2) + (h1 >>> 0)}`;
}"""


def content_change(state: gr.BrowserState, elem_id: str) -> gr.Textbox:
    """The hidden textbox whose `change` follows `state`'s content; call inside the Blocks."""
    fingerprint = gr.Textbox("", visible="hidden", elem_id=elem_id)
    state.change(None, [state], [fingerprint], js=_FINGERPRINT, api_visibility="private",
                 show_progress="hidden")
    return fingerprint
