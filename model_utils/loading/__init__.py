"""What can be loaded and how: the weights, the tokenizer, the mode and the device map, and
nothing of the runtime.

Public names: modes (MODES, get_mode, the dropdown), placement (Placement, the fit estimate),
registry (ModelRegistry, ModelSource), preflight (the checks before an unload),
loaded_model (LoadRequest, LoadedModel, UnloadReport), manager (ModelManager: load, switch,
unload under one lock), memory_accounting (what an unload gives back), load_stages (Progress,
the stages' clock), tokenizer_reuse, adapter (trained adapters applied), demo_model +
demo_chats (the embedded demo model).
"""
