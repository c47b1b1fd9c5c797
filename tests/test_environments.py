"""GRPO in an environment (--environment, TRL's environment_factory): the shop recipe's episodes look two items
up and answer, a turn each, scored by the shop's get_reward; a run trains, logs its turns and episodes, exports,
evaluates with the environment, resumes bit-identically, and trains under DDP and ZeRO-3 as one process on the
same episodes. A bad environment (raises, hangs, dies or returns nonsense in reset, a tool or get_reward; state
left from one episode to the next) ends in one line or is an error result TRL scores, never a hang. The tiny
model cannot write a tool call by chance: a scripted policy (tests/shop_policy.py) writes what a model that
learnt to would."""

from __future__ import annotations

import contextlib
import json
import os
import textwrap
import time
from pathlib import Path

import pytest
import shop_policy
import torch
from conftest import BIN, ROOT, check, free_port, logged, openenv_server, preempt_at, rank_reports, run_cmd
from safetensors.torch import load_file
from smollm2_grpo_env import RECIPE as ENV

from toolkit import run, train
from toolkit.errors import ToolkitError
from toolkit.results.evaluation import evaluate_run
from toolkit.results.record import RunRecord

NAME = "smollm2_grpo_env"


def env_flags(out: Path, *extra: str) -> list[str]:
    return ["--tiny", "--max_steps", "3", "--record_rank_reports", "true", "--report_to", "none", "--save_steps",
            "2", "--eval_fraction", "0.02", "--environment", shop_policy.SHOP, "--dataset_name", shop_policy.ROWS,
            "--output_dir", str(out), *extra]  # fmt: skip


@pytest.fixture
def scripted(monkeypatch):
    from toolkit.training.rl import RecipeGRPOTrainer

    monkeypatch.setattr(RecipeGRPOTrainer, "_generate_single_turn", shop_policy.generate)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    from toolkit.training.rl import RecipeGRPOTrainer

    out = tmp_path_factory.mktemp("env") / "one"
    out.mkdir()  # a run that died here before, at its second step: its episodes are not this run's
    (out / "episodes.jsonl").write_text(json.dumps({"step": 2, "turns": [], "rewards": {}}) + "\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(RecipeGRPOTrainer, "_generate_single_turn", shop_policy.generate)
        train(ENV, env_flags(out), NAME)
    return out


def test_a_run_in_an_environment_plays_its_episodes_scores_trains_and_exports(one_process):
    """Every episode: two lookups and the answer (3 calls), then a last turn: 4 turns; the shop's reward, named
    after its class, varies within a group (the answers are off by -1, 0, +1), so the adapter moves; one episode a
    step in episodes.jsonl with its turns and rewards; the card names the environment and its turns."""
    assert logged(one_process, "environment/turns") == [4.0, 4.0, 4.0]
    assert logged(one_process, "tools/call_frequency") == [3.0, 3.0, 3.0]
    assert logged(one_process, "tools/failure_frequency") == [0.0, 0.0, 0.0]
    assert all(0 < r < 1 for r in logged(one_process, "rewards/Shop/mean"))
    assert logged(one_process, "reward") == logged(one_process, "rewards/Shop/mean")  # the only reward, weight 1
    assert any(n > 0 for n in logged(one_process, "grad_norm"))
    assert all(s > 0 for s in logged(one_process, "environment/seconds"))
    episodes = [json.loads(line) for line in (one_process / "episodes.jsonl").read_text().splitlines()]
    assert [e["step"] for e in episodes] == [1, 2, 3]  # the earlier run's removed, as its log is
    for episode in episodes:
        calls = [m["tool_calls"][0]["function"]["name"] for m in episode["turns"] if m.get("tool_calls")]
        assert calls == ["stock", "stock", "answer"] and episode["rewards"]["Shop"] in (0.0, 1.0)
        said = [m["content"] for m in episode["turns"] if m["role"] == "tool"]
        assert said[-1] == "Answer recorded." and all(s.split()[0].isdigit() for s in said[:2])
    card = (one_process / "README.md").read_text()
    assert "| environment | " + shop_policy.SHOP + ": 4 turns an episode" in card
    assert (one_process / "adapter_model.safetensors").is_file()
    from toolkit.training.episode_processes import OPEN

    assert not OPEN  # the episodes' processes ended with the training (none left holding this process's files)


def test_eval_plays_held_out_episodes_in_the_environment(one_process):
    """`toolkit eval`: base and tuned play the held-out rows' episodes greedily, scored by the shop (the tiny
    random model never calls a tool, so its episodes score 0: what matters is the environment's column)."""
    result = evaluate_run(one_process)
    metrics = {row["metric"]: row for row in result["results"]}
    assert {"Shop", "reward", "finished", "tool_calls"} <= set(metrics)
    assert metrics["Shop"]["base"] == metrics["reward"]["base"] == 0.0
    assert result["inputs"]["base"] == result["inputs"]["tuned"]


class ScriptedModel:
    """A model whose greedy answer is the scripted policy's turn, without the offsets (right answers), ended on
    the tokenizer's end of sequence (the tiny tokenizer spells <|im_end|> in several ids)."""

    def __init__(self, tokenizer) -> None:
        from transformers import GenerationConfig

        self.tokenizer, self.device = tokenizer, torch.device("cpu")
        self.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id)

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **kwargs):
        replies = []
        for ids, mask in zip(input_ids.tolist(), attention_mask.tolist(), strict=True):
            text = self.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
            said = shop_policy.reply(text, 0, offsets=False).replace("<|im_end|>", self.tokenizer.eos_token)
            replies.append(self.tokenizer.encode(said, add_special_tokens=False)[:max_new_tokens])
        width = max(map(len, replies))
        padded = [r + [pad_token_id] * (width - len(r)) for r in replies]
        return torch.cat([input_ids, torch.tensor(padded, dtype=input_ids.dtype)], dim=1)


def test_held_out_episodes_call_the_environment_s_tools_and_read_its_reward(one_process):
    """A model that looks both items up and answers right: every held-out episode scores 1 with the shop, each
    in its own process, each row's own stock."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from toolkit.results.held_out_rewards import held_out_rewards

    tokenizer = AutoTokenizer.from_pretrained(one_process)
    rows = Dataset.from_list([json.loads(line) for line in Path(shop_policy.ROWS).read_text().splitlines()[:4]])
    scores = held_out_rewards(RunRecord.read(one_process), ScriptedModel(tokenizer), tokenizer, rows, batch_size=2)
    assert scores["Shop"] == scores["reward"] == scores["tool_calls"] == scores["finished"] == 1.0


def test_preempted_run_in_an_environment_resumes_bit_identically(one_process, tmp_path, monkeypatch, scripted):
    """SIGTERM at step 2, then resumed: the same losses, rewards and weights as the run that was not stopped."""
    from toolkit.training.stopping import PREEMPTED

    preempt_at(monkeypatch, 2)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        run(ENV, env_flags(out), NAME)
    preempt_at(monkeypatch, -1)
    assert exit_info.value.code == PREEMPTED
    train(ENV, [*env_flags(out), "--resume", "auto"], NAME)
    full, resumed = rank_reports(one_process)[0], rank_reports(out)[0]
    assert resumed["losses"] == full["losses"] and resumed["weights_sha256"] == full["weights_sha256"]
    assert logged(out, "reward")[-1:] == logged(one_process, "reward")[-1:]


def test_the_shop_served_by_openenv_trains_as_the_shop_in_process(one_process, tmp_path, scripted):
    """The shop behind openenv-core's own server (recipes/environments/shop_openenv.py), each episode a WebSocket
    session of its own: the same episodes, rewards, losses and adapter as the shop in the training's process; its
    held-out episodes, played by a model that answers right, score 1 each, as in-process, no more of them at once
    than the evaluation's batch (the server takes 8 sessions: 12 rows at once were once refused)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from toolkit.results.held_out_rewards import held_out_rewards

    out = tmp_path / "served"
    flags = env_flags(out)
    with openenv_server(ROOT / "recipes" / "environments" / "shop_openenv.py", "--sessions", "8") as url:
        flags[flags.index("--environment") + 1] = url
        train(ENV, flags, NAME)
        tokenizer = AutoTokenizer.from_pretrained(out)
        rows = Dataset.from_list([json.loads(line) for line in Path(shop_policy.ROWS).read_text().splitlines()[:12]])
        scores = held_out_rewards(RunRecord.read(out), ScriptedModel(tokenizer), tokenizer, rows, batch_size=4)
    assert scores["ShopEnvironment"] == scores["reward"] == scores["finished"] == 1.0
    keys = ("loss", "reward", "reward_std", "grad_norm", "entropy", "num_tokens", "environment/turns",
            "tools/call_frequency", "tools/failure_frequency", "completions/mean_length")  # fmt: skip
    assert {key: logged(out, key) for key in keys} == {key: logged(one_process, key) for key in keys}
    assert logged(out, "rewards/ShopEnvironment/mean") == logged(one_process, "rewards/Shop/mean")  # the class's name
    assert rank_reports(out)[0]["weights_sha256"] == rank_reports(one_process)[0]["weights_sha256"]
    turns = [[json.loads(line)["turns"] for line in (run / "episodes.jsonl").read_text().splitlines()]
             for run in (out, one_process)]  # fmt: skip
    assert turns[0] == turns[1]


@pytest.mark.launch
@pytest.mark.parametrize("config", ["ddp", "zero3"])
def test_two_processes_train_as_one_on_the_same_episodes(config, one_process, tmp_path):
    """2 processes, a question's 4 episodes on each rank, the same episodes as one process (scripted): the same
    rewards, turns and losses each step, and the same adapter."""
    out = tmp_path / "run"
    config_file = shop_policy.ROOT / "accelerate_configs" / f"{config}.yaml"
    cmd = [str(BIN / "accelerate"), "launch", "--config_file", str(config_file), "--num_processes", "2",
           "--main_process_port", str(free_port()), str(shop_policy.ROOT / "tests" / "shop_policy.py"),
           *env_flags(out, "--per_device_train_batch_size", "4")]  # fmt: skip
    check(run_cmd(cmd, tmp_path))
    for key in ("reward", "environment/turns", "tools/call_frequency"):
        assert logged(out, key) == pytest.approx(logged(one_process, key), abs=1e-6), key
    assert logged(out, "loss") == pytest.approx(logged(one_process, "loss"), rel=1e-4, abs=1e-6)
    ours, reference = load_file(out / "adapter_model.safetensors"), load_file(one_process / "adapter_model.safetensors")
    step_size = RunRecord.read(one_process).settings["learning_rate"] * 3  # tests/test_rl.py says why
    for name, value in reference.items():
        assert float((ours[name] - value).norm()) <= 0.01 * step_size * value.numel() ** 0.5, name


# ------------------------------------------------------------------------------------------ bad environments

BAD = '''
import os, time


class Good:
    def reset(self, items, counts, **row):
        self.given = []

    def answer(self, total: int) -> str:
        """Give the total.

        Args:
            total: The total.
        """
        self.given.append(total)
        return "ok"

    def get_reward(self) -> float:
        return float(len(self.given))


class ResetRaises(Good):
    def reset(self, **row):
        raise ValueError("no such shop")


class ResetHangs(Good):
    def reset(self, **row):
        time.sleep(60)


class ResetDies(Good):
    def reset(self, **row):
        os._exit(3)


class ResetSaysNumber(Good):
    def reset(self, **row):
        return 42


class RewardRaises(Good):
    def get_reward(self):
        raise KeyError("total")


class RewardSaysText(Good):
    def get_reward(self):
        return "yes"


class NoReset:
    def answer(self, total: int) -> str:
        """Give the total.

        Args:
            total: The total.
        """


class Undocumented(Good):
    def look(self, item):
        return item


class NoReward(Good):
    get_reward = None


not_a_class = 3
'''


@pytest.fixture
def bad(tmp_path) -> str:
    path = tmp_path / "bad_envs.py"
    path.write_text(textwrap.dedent(BAD))
    return str(path)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("ResetRaises", "reset failed, so the episode cannot begin: ValueError: no such shop (tried on the first row"),
        ("ResetHangs", "reset failed, so the episode cannot begin: no result within 1 s (--tool_timeout)"),
        ("ResetDies", "reset failed, so the episode cannot begin: the environment's process died (exit code 3)"),
        ("ResetSaysNumber", "TypeError: returned int, not text, None or a list of content blocks"),
        ("RewardRaises", "get_reward failed, so the episode cannot be scored: KeyError: 'total'"),
        ("RewardSaysText", "cannot be scored: TypeError: returned 'yes', not a number"),
        ("NoReset", "NoReset has no reset(): TRL calls it to begin each episode"),
        ("Undocumented", "tool look's JSON schema cannot be read"),
        ("NoReward", "no reward: give the class a get_reward()"),
        ("not_a_class", "names 3, which is not a class"),
        ("Missing", "has no class 'Missing'"),
    ],
)
def test_an_environment_that_cannot_play_is_one_line_before_weights_load(name, message, bad, tmp_path):
    """Each found on its class or on one trial episode of the first row, in time (--tool_timeout 1), before any
    weights load: one line naming the environment and what failed."""
    from toolkit.models import loading

    start = time.monotonic()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
        with pytest.raises(ToolkitError) as error:
            train(ENV, ["--tiny", "--report_to", "none", "--tool_timeout", "1", "--environment", f"{bad}:{name}",
                        "--dataset_name", shop_policy.ROWS, "--output_dir", str(tmp_path / "run")], NAME)  # fmt: skip
    assert message in str(error.value) and "\n" not in str(error.value)
    assert time.monotonic() - start < 30
    assert not (tmp_path / "run").exists()


def handle(cls, seconds: float = 1.0):
    from toolkit.training.environments import EnvironmentFactory

    return EnvironmentFactory(cls, cls.__name__, seconds)()


class Tools:
    calls = 0  # a class attribute an episode changes: the next must not see it

    def reset(self, **row):
        self.seen = getattr(self, "seen", 0) + 1  # state reset forgets to clear

    def count(self) -> str:
        """How many calls this episode, its instance and its class have seen."""
        global CALLS
        type(self).calls += 1
        CALLS = globals().get("CALLS", 0) + 1
        return f"{self.seen} {type(self).calls} {CALLS}"

    def raises(self) -> str:
        """Raise."""
        raise ValueError("out of stock")

    def hangs(self) -> str:
        """Hang."""
        time.sleep(60)

    def dies(self) -> str:
        """Die."""
        import os

        os._exit(5)

    def nonsense(self) -> str:
        """Return an object."""
        return object()

    def dies_later(self) -> str:
        """Answer, then die."""
        import os
        import threading

        threading.Timer(0.2, os._exit, (6,)).start()
        return "ok"

    def get_reward(self) -> float:
        return 1.0


def test_no_state_leaks_from_one_episode_to_the_next():
    """An instance attribute reset forgot, a class attribute and a module global, each changed by an episode:
    every episode starts from the instance as it was built, in a process of its own."""
    env = handle(Tools)
    for _ in range(3):
        env.reset()
        assert env.count() == "1 1 1"
    other = handle(Tools)  # another handle (TRL pools them) starts from the same instance too
    other.reset()
    assert other.count() == "1 1 1" and Tools.calls == 0 and "CALLS" not in globals()


@pytest.mark.parametrize(
    ("tool", "error"),
    [
        ("raises", "ValueError: out of stock"),
        ("hangs", "no result within 1 s (--tool_timeout): stopped"),
        ("dies", "the environment's process died (exit code 5) before dies answered"),
        ("nonsense", "TypeError: returned object, not text, a number, a list or a dict"),
    ],
)
def test_a_tool_that_fails_is_an_error_result_in_time_and_a_stopped_episode_goes_unscored(tool, error):
    """What TRL's tool loop catches and gives the model as {"error": ...} (counted in tools/failure_frequency):
    within the time limit; a hung or dead episode's later calls are errors too, and its reward None (unscored,
    counted), never a silent 0; the next episode plays again."""
    env = handle(Tools)
    env.reset()
    start = time.monotonic()
    with pytest.raises(Exception) as raised:
        getattr(env, tool)()
    assert str(raised.value) == error and time.monotonic() - start < 5
    stopped = tool in ("hangs", "dies")
    if stopped:
        with pytest.raises(RuntimeError, match="this episode's environment was stopped earlier"):
            env.count()
    assert env.get_reward() == (None if stopped else 1.0)
    assert env.factory.unscored == int(stopped)
    env.reset()
    assert env.count() == "1 1 1" and env.get_reward() == 1.0


def test_an_episode_whose_process_dies_between_calls_is_stopped_not_a_traceback():
    """Its process gone while no call ran (the pipe broken when the next call is sent): that call is an error
    result saying how it ended, and the episode goes unscored, as one that dies in a call."""
    env = handle(Tools)
    env.reset()
    assert env.dies_later() == "ok"
    time.sleep(1)
    with pytest.raises(RuntimeError, match=r"the environment's process died \(exit code 6\) before count answered"):
        env.count()
    assert env.get_reward() is None and env.factory.unscored == 1


def test_a_tool_that_fails_in_training_is_scored_as_trl_scores_it(bad, tmp_path, capsys, monkeypatch):
    """A run whose episodes all hang on their first call (--tool_timeout 1): each call an error result in time
    (tools/failure_frequency 1), every episode stopped and unscored, and the run says how many; the header names
    the environment and its limits, and a profile's split shows its time apart from sampling."""
    from toolkit.training.rl import RecipeGRPOTrainer

    def hangs_at_once(self, prompt_ids, *args, **kwargs):
        call = '<tool_call>\n{"name": "hangs", "arguments": {}}\n</tool_call><|im_end|>'
        return [self.processing_class.encode(call, add_special_tokens=False) for _ in prompt_ids], None

    path = tmp_path / "tools_env.py"
    path.write_text("import time\n" + textwrap.dedent('''
        class Hangs:
            def reset(self, **row):
                pass

            def hangs(self) -> str:
                """Hang."""
                time.sleep(60)

            def get_reward(self) -> float:
                return 1.0
        '''))  # fmt: skip
    monkeypatch.setattr(RecipeGRPOTrainer, "_generate_single_turn", hangs_at_once)
    out = tmp_path / "run"
    start = time.monotonic()
    run(ENV, ["--tiny", "--max_steps", "1", "--report_to", "none", "--save_strategy", "no", "--tool_timeout", "1",
              "--max_tool_calls", "1", "--environment", f"{path}:Hangs", "--dataset_name", shop_policy.ROWS,
              "--profile", "1", "--output_dir", str(out)], NAME)  # fmt: skip
    assert time.monotonic() - start < 120
    assert logged(out, "tools/failure_frequency") == [1.0]
    said = capsys.readouterr()
    assert "environment " + f"{path}:Hangs: 8 episode(s) were stopped" in said.err
    assert "\nrewards       Hangs's get_reward x 1; no reference model (beta 0)\n" in said.out
    assert f"\nenvironment   {path}:Hangs, tools hangs, scored by its get_reward (TRL's environment_factory" in said.out
    said_limits = "an episode: at most 2 turns (768 tokens in all, tool results included: ~384 a turn), each call at"
    assert said_limits + " most 1 s" in said.out
    assert "UserWarning" not in said.err
    # the profile's split: the environment's 8 s of waiting (1 s a call), apart from the sampling
    split = json.loads((out / "profile" / "rank0.split.json").read_text())
    assert split["environment"]["ms"] >= 8 * 1000 and split["environment"]["share"] > 0.2
    assert 0 < split["sampling"]["ms"] < split["environment"]["ms"]


def test_rows_pick_their_environment_by_name(bad, tmp_path):
    """Several environments by name: each row's `environment` column picks one; a name not among them, or no
    column, is one line."""
    from datasets import Dataset

    from toolkit.errors import DataError
    from toolkit.settings.policy import PolicyArguments
    from toolkit.training.environment_checks import environment_factories

    rows = [{"prompt": [{"role": "user", "content": "hi"}], "items": ["a"], "counts": [1]}]
    policy = PolicyArguments(environment=f"good={bad}:Good,also={bad}:RewardRaises".replace("RewardRaises", "Good"))
    factories = environment_factories(policy, Dataset.from_list([{**rows[0], "environment": "good"}]), [])
    assert set(factories) == {"good", "also"} and type(factories["good"]()).__name__ == "Good"
    with pytest.raises(DataError, match="row 0: environment 'shop' is not among --environment's"):
        environment_factories(policy, Dataset.from_list([{**rows[0], "environment": "shop"}]), [])
    with pytest.raises(DataError, match="has none: add it"):
        environment_factories(policy, Dataset.from_list(rows), [])


class Sessions:
    """A server that keeps a count a connection, as OpenEnv's keeps a session a WebSocket: `reset` zeroes the
    connection's count, `add` raises it, `get` says it."""

    def __init__(self) -> None:
        import socketserver
        import threading

        class Session(socketserver.StreamRequestHandler):
            def handle(self):
                count = 0
                with contextlib.suppress(OSError):  # an episode's process killed mid-session resets its link
                    for line in self.rfile:
                        word = line.strip().decode()
                        count = 0 if word == "reset" else count + 1 if word == "add" else count
                        self.wfile.write(f"{count}\n".encode())

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Session)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_class_that_connects_when_built_gets_a_connection_an_episode(tmp_path):
    """TRL's OpenEnv examples open their client in __init__: forked from one such instance, every episode would
    talk over one connection, one session, and two episodes at once would count each other's steps. Built in each
    episode's process instead, each has its own: two interleaved episodes count their own."""
    server = Sessions()
    path = tmp_path / "client_env.py"
    path.write_text(textwrap.dedent(f'''
        import socket


        class Client:
            def __init__(self):
                self.link = socket.create_connection(("127.0.0.1", {server.server.server_address[1]}))
                self.file = self.link.makefile("rw")

            def say(self, word):
                self.file.write(word + "\\n")
                self.file.flush()
                return self.file.readline().strip()

            def reset(self, **row):
                self.say("reset")

            def add(self) -> str:
                """Add one."""
                return self.say("add")

            def get_reward(self) -> float:
                return float(self.say("get"))
        '''))  # fmt: skip
    from toolkit.training.environment_checks import environment_class
    from toolkit.training.environments import EnvironmentFactory

    factory = EnvironmentFactory(environment_class(f"{path}:Client", 5.0), "client", 5.0)
    first, second = factory(), factory()
    try:
        first.reset()
        second.reset()
        assert [first.add(), first.add(), second.add()] == ["1", "2", "1"]
        assert (first.get_reward(), second.get_reward()) == (2.0, 1.0)
        assert factory.instance is factory.cls  # built in each episode's process
    finally:
        first._close()
        second._close()
        server.server.shutdown()


class Memory:
    def reset(self, **row) -> None:
        pass

    def resident(self) -> str:
        """This process's resident memory in bytes, and its parent's pid."""
        rss = next(line for line in open("/proc/self/smaps_rollup") if line.startswith("Rss:"))
        return f"{int(rss.split()[1]) * 1024} {os.getppid()}"


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").is_file(), reason="reads Linux's /proc")
def test_episodes_are_forked_from_a_small_process_not_the_training_one():
    """A fork shares the parent's pages as they were and keeps them while it lives, and the parent's next write to
    one copies it: forked from the training process mid-step, the shop demo's 16 episodes a step pinned the
    sampler's 14 GB and the machine ran out of its 24 GiB. Episodes are forked by a spawner started at the first
    one: an episode begun after this process grew by 512 MiB holds none of it."""
    from toolkit.training.environments import EnvironmentFactory

    factory = EnvironmentFactory(Memory, "memory", 5.0)
    first = factory()
    first.reset()
    grown = bytearray(512 * 2**20)
    grown[:: 2**12] = b"\1" * len(range(0, len(grown), 2**12))  # every page written: resident
    second = factory()
    second.reset()
    try:
        resident, parent = map(int, second.resident().split())
        assert parent not in (os.getpid(), 0) and parent == int(first.resident().split()[1])  # the one spawner
        ours = int(next(line for line in open("/proc/self/smaps_rollup") if line.startswith("Rss:")).split()[1])
        assert resident < ours * 1024 - len(grown)
    finally:
        first._close()
        second._close()
        factory.close()
    assert not factory.spawner and grown


def test_the_shop_s_sft_episodes_are_played_right_and_are_its_traces(monkeypatch):
    """recipes/data/shop_traces.jsonl (the environment demo's SFT stage) is what the shop's traces() writes, and
    each episode, its calls replayed in the shop with the counts its lookups read, gets back the results it shows
    and scores 1: the SFT stage teaches episodes the GRPO stage's reward calls right."""
    monkeypatch.syspath_prepend(str(Path(shop_policy.SHOP.split(":")[0]).parent))
    import shop

    path = Path(shop.__file__).parents[1] / "data" / "shop_traces.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == json.loads(json.dumps(shop.traces(len(rows))))
    assert {len([m for m in r["messages"] if m["role"] == "tool"]) for r in rows} == {2, 3}  # one item, two items
    for row in rows:
        results = [m["content"] for m in row["messages"] if m["role"] == "tool"]
        items = [m["tool_calls"][0]["function"]["arguments"]["item"] for m in row["messages"]
                 if m.get("tool_calls") and m["tool_calls"][0]["function"]["name"] == "stock"]  # fmt: skip
        env = shop.Shop()
        env.reset(items=items, counts=[int(r.split()[0]) for r in results[: len(items)]])
        replayed = [getattr(env, c["function"]["name"])(**c["function"]["arguments"])
                    for m in row["messages"] for c in m.get("tool_calls") or []]  # fmt: skip
        assert replayed == results and env.get_reward() == 1.0


def test_a_spawner_that_died_is_one_line_at_the_next_reset():
    """The process episodes are forked from, killed (the OOM killer, a user): the next reset is one line naming how
    it ended, not a traceback from a closed pipe."""
    from toolkit.training.environments import EnvironmentFactory, EnvironmentFailure

    factory = EnvironmentFactory(Memory, "memory", 5.0)
    first = factory()
    first.reset()
    first._close()
    factory.spawner.process.kill()
    with pytest.raises(EnvironmentFailure, match=r"^environment memory: reset failed, so the episode cannot begin: "
                       r"the process its episodes are forked from ended \(killed by SIGKILL\)$"):  # fmt: skip
        factory().reset()
    factory.close()
