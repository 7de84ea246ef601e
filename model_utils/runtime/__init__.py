"""How tokens are made once a model is loaded.

Public names: preparation.DecodePreparation (a loaded model made ready: returns a
serving.Serving), serving.Serving (decode path, scheduler, memory stages), scheduler.Scheduler
(the queue, admission and rows; pure Python) over runner.BatchRunner (forward passes, the paged
KV cache, sampling on the device), generation_settings (GenerationSettings and the settings'
schema; no torch), reply_stats.ReplyStats (no torch), grammar (constrained decoding),
decoders.EagerDecoder and generation.decode_tokens (one reply alone), worker.DecodeWorker (the
thread of every forward pass).
"""
