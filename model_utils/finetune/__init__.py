"""A fine-tuning run as a process of its own: the command line and the app's handle on a run.

cli.py         python -m model_utils.finetune (also under `accelerate launch`): resolves the
               model by name through the registry, then runs model_utils.training
runner.py      the server's side: starts, follows and stops a run in a child process
run_lock.py    OUT/run.json: the run names its process, so a server finds a run it did not start
bench.py       the training benchmark (ours against a plain loop)
"""
