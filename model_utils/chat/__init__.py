"""Conversations as text: prompt (messages -> the chat template's prompt, trimmed to the
context), reasoning (Qwen3's thinking apart from the answer), reply_stream (tokens ->
ChatUpdates), updates (ChatUpdate, TokenLogprob), tool_calls (tool calls read from an answer),
budget (how much of the context a prompt will take, or an estimate without a tokenizer).
No torch here.
"""
