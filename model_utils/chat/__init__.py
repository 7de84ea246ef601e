"""Conversations as text: prompt (messages -> the chat template's prompt, trimmed to the
context), reasoning (Qwen3's thinking apart from the answer), reply_stream (tokens ->
ChatUpdates), updates (ChatUpdate, TokenLogprob), tool_calls (tool calls read from an answer).
No torch here.
"""
