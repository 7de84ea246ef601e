"""The engine: everything below the web server, with no gradio and no HTTP.

Public names, each imported from the module that defines it (no package re-exports them):
engine_config.EngineConfig (the options, their checks and flags), engine_factory.build_engine
(the engine a config describes), engine.Engine (load/unload/switch, chat, status, memory),
errors (every error raised to callers), memory (snapshots and the sampler), process_tuning
(what a long-running host changes process-wide). Subpackages, bottom up: layers and training
(the fine-tuning loop), loading, runtime, chat (prompts and replies as text), then the fronts:
finetune (a training run as a process), backends (--backend), parallel (--tp), bench.
ARCHITECTURE.md draws the layers.
"""
