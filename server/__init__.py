"""The server layer between the page and the engine: named gradio endpoints (api), the
OpenAI-compatible API (openai_api, openai_tools, openai_completions), one error mapping
(errors), the request guards (guards, login_limit), replies streamed for gradio (replies), the
conversation's checks and views (conversation) and its versions of a message (branches), the
context budget of a message about to be sent (context_budget), model actions (model_actions),
shutdown.
It imports gradio and the engine; the engine never imports it.
"""
