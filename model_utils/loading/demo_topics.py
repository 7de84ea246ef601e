"""What the demo model knows: one entry per topic, with the ways a user may ask for it.

Each topic is (phrasings, answer, reasoning or None). The phrasings are hand-written seeds: full
questions in several shapes (how / what / can I / I want to ...), and short keyword-style ones,
as users type them into a chat box. demo_chats.py multiplies them (synonyms, openers, case) into
the training conversations; a tiny model trained from scratch only links a word to a topic if it
has seen that word with the topic, so the seeds favour many different content words over many
sentence shapes for the same words.
"""

from __future__ import annotations

GREETING = ("Hello! I am the tiny demo model of this app. Ask me about the modes, the memory "
            "cards, sharing, the benchmark or the command line.")

# (phrasings, answer, reasoning or None)
TOPICS: list[tuple[list[str], str, str | None]] = [
    (["Hello", "Hi", "Hey there", "Good morning", "Hi, who is there?", "Good evening",
      "Hello there", "Greetings"], GREETING, None),
    (["Who are you?", "What are you?", "Are you a real model?", "What model is this?",
      "Which model am I talking to?", "Are you a bot?", "Introduce yourself",
      "What kind of assistant are you?", "who am I chatting with"],
     "I am a tiny demo model, trained in about a minute on questions about this app. Load a "
     "real model in the Model tab for real answers.", None),
    (["How are you?", "How are you doing today?", "How is it going?", "How do you feel?",
      "Are you ok?"],
     "I am fine, thank you. I am a tiny demo model, so I only know about this app.", None),
    (["Thank you", "Thanks a lot", "Thanks, that helps", "Great, thanks", "Cheers",
      "That was helpful"],
     "You are welcome! Ask me anything else about the app.", None),
    (["Bye", "Goodbye", "See you later", "That is all for now", "Bye bye"],
     "Goodbye! Have a nice day.", None),
    (["What can you do?", "What do you know?", "How can you help me?", "Help",
      "What can I ask you?", "What topics do you cover?", "What are you good at?"],
     "I can answer questions about this app: the precision modes, how to switch them, the "
     "memory cards, safe sharing, the benchmark and the command line.", None),
    (["Why is the demo model so small?", "Why are your answers so short?",
      "Why do you only know about this app?", "How many parameters do you have?",
      "Why are you so limited?"],
     "I am a tiny model with about a million weights, built on first use in about a minute on "
     "the CPU. I learned only a few hundred short conversations about this app.",
     "The user asks why I am small. I was trained in about a minute on the CPU, so I can only "
     "be tiny and know little."),
    # -- modes ---------------------------------------------------------------------------------
    (["What modes are there?", "Which modes can I choose?", "What are the modes?",
      "What do the modes mean?", "List the precision modes", "Which precisions are supported?",
      "What dtypes can I load a model in?", "Which quantization formats exist here?",
      "list of modes", "available modes", "Show me all the precision choices"],
     "The modes are fp32, bf16, fp16, int8, nf4, nf4-dq, fp4 and fp4-dq. They set how many "
     "bytes each weight takes in memory.", None),
    (["What is fp32?", "What does fp32 mean?", "Tell me about the fp32 mode", "fp32",
      "Is fp32 full precision?", "How big is a parameter in fp32?", "fp32 size per parameter",
      "Explain float32"],
     "fp32 is full precision: 4 bytes per parameter. It is the most exact mode and the "
     "largest one.", None),
    (["What is bf16?", "What does bf16 mean?", "Tell me about the bf16 mode", "bf16",
      "Explain bfloat16", "How many bytes does bf16 take?", "bf16 size per parameter"],
     "bf16 is the 16-bit brain float: 2 bytes per parameter, with the range of fp32 and less "
     "precision. It is the usual mode on a GPU.", None),
    (["What is fp16?", "What does fp16 mean?", "Tell me about the fp16 mode", "fp16",
      "Explain float16 half precision", "fp16 size per parameter"],
     "fp16 is 16-bit half precision: 2 bytes per parameter. It has more precision than bf16 "
     "but a smaller range.", None),
    (["What is the difference between bf16 and fp16?", "bf16 or fp16?",
      "Should I use bf16 or fp16?", "fp16 vs bf16", "Compare bf16 with fp16",
      "Are fp16 and bf16 different?", "bf16 versus fp16, which is better?"],
     "Both take 2 bytes per parameter. bf16 keeps the range of fp32, fp16 keeps more digits; "
     "bf16 is the safer choice for large models.",
     "Both are 16 bits. bf16 has 8 exponent bits like fp32, fp16 has more mantissa bits. "
     "Overflow is the bigger risk, so bf16."),
    (["What is int8?", "What does int8 mean?", "Tell me about the int8 mode",
      "What is LLM.int8?", "int8", "Is int8 accurate?", "How good is int8 quality?",
      "Does 8-bit quantization lose accuracy?", "int8 outliers", "Explain 8-bit mode"],
     "int8 is LLM.int8 from bitsandbytes: about 1 byte per parameter. Outlier features stay in "
     "16 bits, so the quality holds up well.", None),
    (["What is nf4?", "What does nf4 mean?", "Tell me about the nf4 mode",
      "What is 4-bit NormalFloat?", "nf4", "Explain nf4 quantization", "How does nf4 work?",
      "nf4 meaning"],
     "nf4 is 4-bit NormalFloat from bitsandbytes: about half a byte per parameter. Its levels "
     "follow the normal distribution of the weights.", None),
    (["What is fp4?", "What does fp4 mean?", "Tell me about the fp4 mode", "fp4",
      "Explain the plain 4-bit float", "fp4 or nf4?"],
     "fp4 is a plain 4-bit float from bitsandbytes: about half a byte per parameter, usually a "
     "little less exact than nf4.", None),
    (["What does -dq mean?", "What is nf4-dq?", "What is double quantization?",
      "What is fp4-dq?", "dq", "Why use the -dq modes?", "How much does double quant save?",
      "nf4-dq vs nf4", "What is the dq suffix for?"],
     "The -dq modes add double quantization: the scales of the 4-bit blocks are quantized too, "
     "which saves about 0.4 bits per parameter.", None),
    (["Which mode should I pick?", "Which mode is best?", "What mode should I use?",
      "Which mode do you recommend?", "My model does not fit, what now?",
      "How do I make a model smaller?", "How can I save VRAM?", "Out of memory when loading",
      "How do I fit a bigger model?", "best mode", "Reduce the memory footprint"],
     "Use bf16 when the model fits on your GPU. If it does not, try int8, then nf4 or nf4-dq, "
     "which need about a quarter of the memory.",
     "The best mode depends on memory. bf16 is exact enough and fast, int8 halves it, nf4 "
     "quarters it. So start with bf16 and go down only if it does not fit."),
    (["How much memory does a 7B model need?", "How big is a 7B model?",
      "Will a 7B model fit on my GPU?", "7B memory", "How many GB for 7 billion parameters?"],
     "About 15 GB in bf16, 8 GB in int8 and 5 GB in nf4, plus the KV cache. The Model tab "
     "shows the estimate before you load.",
     "7 billion parameters times the bytes per parameter: 2 in bf16, about 1 in int8, about "
     "half a byte in nf4."),
    (["What is the compute dtype?", "What does compute dtype mean?", "compute dtype",
      "Which dtype do the 4-bit modes compute in?"],
     "The compute dtype is the type the 4-bit modes compute in after unpacking the weights. "
     "bf16 is the default; change it under Advanced in the Model tab.", None),
    # -- switching -----------------------------------------------------------------------------
    (["How do I switch modes?", "How do I change the mode?", "How can I switch to nf4?",
      "How do I switch the precision?", "How do I change the precision mode?",
      "Reload the model in int8", "Move from fp16 to nf4", "change mode", "switch to bf16",
      "Can I load the same model in another precision?", "Convert the model to 4-bit"],
     "Open the Model tab, pick a mode and press Load. The old model is unloaded first, and if "
     "the new load fails it comes back.", None),
    (["What happens if a load fails?", "What if the new model does not load?",
      "What if the switch fails?", "Loading crashed, is my model gone?", "failed load",
      "Does a broken switch lose the current model?", "What if loading runs out of memory?"],
     "The previous model is loaded again, same mode and same placement, and the page says why "
     "the new one failed.", None),
    (["How do I load another model?", "How do I load a real model?", "How do I pick a model?",
      "Can I use a model from a local folder?", "Load a Hugging Face model", "load model",
      "Where do I choose the checkpoint?"],
     "Pick it in the model list of the Model tab, or type a folder path or a hub id, then "
     "press Load.", None),
    (["What is the placement?", "What does placement mean?", "Where do the weights go?",
      "What is device_map auto?", "Can I spread a model over two GPUs?", "placement"],
     "The placement says where the weights go: the cpu, one GPU, or the auto, balanced and "
     "sequential strategies of accelerate.", None),
    (["Can I switch while a reply is streaming?", "What if I switch during a reply?",
      "Does a switch wait for running chats?"],
     "A switch waits for the replies in flight to end, holds new ones back meanwhile, and says "
     "so if it takes too long.", None),
    (["How do I unload the model?", "How do I free the memory?", "Release the GPU memory",
      "unload", "Empty the VRAM", "How do I remove the model from memory?"],
     "Press Unload in the Model tab. The page then says whether all the memory came back.",
     None),
    # -- memory --------------------------------------------------------------------------------
    (["What do the memory cards show?", "What is on the memory cards?",
      "What does the Memory tab show?", "Explain the memory cards", "memory cards",
      "What are the numbers on a GPU card?", "Which values does the Memory tab list?",
      "What does NVML report here?"],
     "Each card shows one GPU: the memory used out of the total from NVML, and what torch has "
     "allocated and reserved. Below them are the CPU RAM and this process.", None),
    (["What is the difference between allocated and reserved?", "What does reserved mean?",
      "What is allocated memory?", "allocated vs reserved", "Why is reserved bigger?",
      "Explain the torch caching allocator"],
     "Allocated is the memory tensors use now. Reserved is what torch keeps from the GPU, "
     "allocated plus cached free blocks, so it is never smaller.",
     "Allocated counts live tensors. Reserved counts what the caching allocator took from the "
     "GPU, including the free blocks it keeps for later."),
    (["What if I have no GPU?", "Does it work without a GPU?", "Can I run it on the CPU?",
      "Is CUDA required?", "no GPU", "Will my laptop work?", "CPU only"],
     "Yes. Without a GPU every mode runs on the CPU, slowly, and the Memory tab shows the CPU "
     "RAM and this process.", None),
    (["How often do the cards refresh?", "What does the memory plot show?",
      "What is the refresh rate of the Memory tab?", "refresh interval",
      "Is the memory chart live?"],
     "The cards refresh every 2 seconds, and the plot shows the last five minutes.", None),
    (["What is RSS?", "What does process RSS mean?", "RSS"],
     "RSS is the memory of this process in RAM. It drops after an unload, when the weights are "
     "freed.", None),
    # -- sharing -------------------------------------------------------------------------------
    (["How do I share the app safely?", "How do I share it?", "How can I share the app?",
      "How do I make a public link?", "Is sharing safe?", "share link",
      "Let a friend use the app remotely", "Can someone else open my app from home?",
      "How do I publish it online?"],
     "Start with --share and at least one --auth user:password. Add --admin with one user, so "
     "that only that user may load or switch models.",
     "A public link is open to anyone who has it, so it needs a login, and model changes "
     "should be for one user only."),
    (["What if I use --share without --auth?", "Can I share without a password?",
      "share without login"],
     "The app refuses: --share without --auth prints a message and exits with status 2 before "
     "anything is loaded.", None),
    (["What does --admin do?", "What is the admin user?", "Who may load models?",
      "Can other users change the model?", "admin", "Restrict model loading to me"],
     "--admin USER lets only that logged-in user load, unload or switch models and train. "
     "Every other login may still chat.", None),
    (["What does --auth do?", "How do I add a login?", "How do I add users?", "auth",
      "How do I protect the page with a password?", "Require a username to open the UI",
      "Can I lock the app?"],
     "--auth user:password adds a login for the page and the API. Repeat it for more users, or "
     "use --auth-file with one user:password a line.", None),
    (["Can I bind to 0.0.0.0?", "How do I serve on my network?", "Open it to my home network",
      "Listen on all interfaces", "host", "Access the app from my phone on wifi"],
     "Yes, with --host 0.0.0.0, but any address other than 127.0.0.1 also needs --auth, the "
     "same as --share.", None),
    # -- benchmark -----------------------------------------------------------------------------
    (["How do I run the benchmark?", "How do I benchmark a model?",
      "How can I measure the speed?", "How do I run the bench?", "benchmark",
      "Measure tokens per second", "How fast is the model?", "Test the generation speed",
      "Compare the speed of two modes"],
     "Open the Benchmark tab and press Run benchmark, or run python -m model_utils.bench "
     "--model demo --modes bf16,nf4 on the command line.", None),
    (["What does the benchmark measure?", "What does the Benchmark tab show?",
      "What is time to first token?", "bench metrics"],
     "It measures the time to first token and the tokens per second of this app's decode path, "
     "and compares them with plain model.generate on the same weights.", None),
    (["Where are the benchmark results?", "Where are the measured figures?",
      "Are there published speed numbers?", "benchmark results", "Show me past results"],
     "The bench command prints a table and writes JSON with --out and a chart. Measured "
     "figures are in BENCHMARKS.md.", None),
    (["What is the fast path?", "Why is the GPU so fast?", "Does it use CUDA graphs?",
      "static KV cache"],
     "On a CUDA GPU replies decode with a static KV cache and CUDA graphs. On the CPU the eager "
     "path is used.", None),
    # -- command line and the rest -------------------------------------------------------------
    (["What does the CLI do?", "Is there a command line?", "How do I chat without a browser?",
      "What is python -m model_utils chat?", "CLI", "Use it from a shell",
      "Chat in the console", "command line chat"],
     "python -m model_utils chat loads a model and streams one reply to the terminal, with no "
     "browser. python -m model_utils prompt prints the prompt the model receives.", None),
    (["How do I get JSON from the CLI?", "What does --json do?", "json output"],
     "Add --json to chat to get one JSON object at the end, with the text, the token counts "
     "and the timings.", None),
    (["How do I fine-tune a model?", "How do I train an adapter?", "How do I fine-tune?",
      "Train on my own chats", "fine-tune", "Make a LoRA", "Adapt the model to my dataset",
      "Can I do LoRA training here?"],
     "Run python -m model_utils.finetune --model demo --data chats.jsonl --out "
     "models/my-adapter, or use the Train tab.", None),
    (["What does the Train tab do?", "What is the Train tab?", "Train tab",
      "What is the Train tab for?", "Explain the training page"],
     "The Train tab fine-tunes a model on a JSONL file of chats, shows the loss curve live, and "
     "puts the adapter in the model list.", None),
    (["How do I start the app?", "How do I run the app?", "How do I install it?",
      "Launch the server", "setup", "First steps to launch", "How do I open the UI?"],
     "Run ./start.sh. The first run sets up the virtual environment, then the app serves on "
     "http://127.0.0.1:7860.", None),
    (["What is the Thinking switch?", "What does Thinking do?", "What is thinking mode?",
      "thinking", "Should I turn on reasoning?", "Why does the model think first?"],
     "The Thinking switch lets a Qwen3 model reason in a think block before it answers. The "
     "reasoning is shown apart from the answer.",
     "The user asks about the switch. When it is on, the model writes its reasoning first, "
     "like this."),
    (["Is there an OpenAI API?", "Can I use an OpenAI client?", "OpenAI compatible",
      "Call the model over HTTP", "Is there a REST endpoint?", "API"],
     "Yes: POST /v1/chat/completions speaks the OpenAI chat format, so any OpenAI client can "
     "use the loaded model.", None),
    (["Where are the logs?", "Are my prompts logged?", "logs", "Is my chat history saved?",
      "Does the server record what I type?", "privacy"],
     "Logs go to server.log. Prompts and replies are not logged unless you start the app with "
     "--log-prompts.", None),
    (["How do I run the tests?", "How do I test the app?", "tests", "Run pytest",
      "Check that everything works"],
     "Run ./test.sh. It runs everything on the CPU with the demo model.", None),
    (["What does Stop do?", "How do I stop a reply?", "stop", "Stop generating",
      "The answer is too long, how do I end it?", "Interrupt the model"],
     "Stop ends the reply within one decode step. Closing the tab does the same.", None),
]
