"""Environments served in OpenEnv's protocol (--environment http://..., served_environments.py), against
openenv-core's own server (0.3.0, from .venv-openenv, which `make install` builds): an MCP environment's tools
and a plain one's action become the class's tools with the schemas the server gives; each episode its own
session, told its row; its return summed from the answers (0 if none carried a reward); done, a tool's error, a
server that fails reset or goes away: error results or one line, never a hang. Training against the served shop
equals training against the shop in-process: tests/test_environments.py."""

from __future__ import annotations

import time

import pytest
from conftest import ROOT, openenv_server
from transformers.utils import get_json_schema

from toolkit.errors import ConfigError
from toolkit.training.environments import EnvironmentFactory, EnvironmentFailure, tool_names
from toolkit.training.served_environments import served_class

GUESS = ROOT / "tests" / "openenv_guess.py"
SHOP = ROOT / "recipes" / "environments" / "shop_openenv.py"


@pytest.fixture(scope="module")
def guess():
    with openenv_server(GUESS) as url:
        yield url


def handles(url: str, n: int = 1):
    factory = EnvironmentFactory(served_class(url, 5.0), url, 5.0)
    return [factory() for _ in range(n)]


def test_a_plain_environment_s_action_is_its_one_tool_and_its_episodes_are_their_own(guess):
    """Guess a number: one tool, `step`, with the action's field and descriptions; two episodes played at once keep
    their own secrets (their own sessions); the reward is the sum of the answers' (-0.1 a wrong guess, 1 the
    right one); after done, a call is an error result."""
    cls = served_class(guess, 5.0)
    assert cls.__name__ == "GuessEnvironment" and tool_names(cls) == ["step"]
    assert get_json_schema(cls.step)["function"] == {
        "name": "step", "description": "Guess the hidden number.", "return": {"type": "string"},
        "parameters": {"type": "object", "required": ["guess"],
                       "properties": {"guess": {"type": "integer", "description": "A whole number from 1 to 20."}}},
    }  # fmt: skip
    first, second = handles(guess, 2)
    try:
        prompt = [{"role": "user", "content": "Guess."}]
        assert first.reset(secret=12, prompt=prompt) == "I am thinking of a number from 1 to 20."
        second.reset(secret=3, prompt=prompt)
        assert [first.step(guess=5), second.step(guess=5), first.step(guess=15)] == ["Higher.", "Lower.", "Lower."]
        assert first.step(guess=12) == "Right."
        with pytest.raises(RuntimeError, match=r"the episode has ended \(the environment said done"):
            first.step(guess=12)
        assert first.get_reward() == pytest.approx(0.8) and second.get_reward() == pytest.approx(-0.1)
        first.reset(secret=4, prompt=prompt)  # a new episode, a new session: nothing of the last
        assert first.step(guess=4) == "Right." and first.get_reward() == 1.0
    finally:
        first._close()
        second._close()


def test_an_mcp_environment_s_tools_are_the_in_process_class_s():
    """The shop served by OpenEnv's MCP environment: the tools TRL is offered have exactly the in-process shop's
    schemas (same prompt tokens); a tool's error (a wrong argument) is an error result with the server's reason."""
    from environments.shop import Shop

    with openenv_server(SHOP) as url:
        cls = served_class(url, 5.0)
        assert tool_names(cls) == ["answer", "stock"]
        assert all(get_json_schema(getattr(cls, n)) == get_json_schema(getattr(Shop, n)) for n in ("answer", "stock"))
        (shop,) = handles(url)
        try:
            shop.reset(items=["figs", "limes"], counts=[4, 9])
            assert shop.stock(item="limes") == "9 limes" and shop.get_reward() == 0.0  # never answered: as Shop's
            assert shop.reset(items=["figs", "limes"], counts=[4, 9]) is None
            assert shop.stock(item="limes") == "9 limes"
            with pytest.raises(RuntimeError, match="Missing required argument"):
                shop.stock(name="limes")
            assert shop.answer(total=13) == "Answer recorded." and shop.get_reward() == 1.0
        finally:
            shop._close()


def test_a_server_that_fails_or_goes_away_is_one_line_or_an_error_result():
    """Nothing listening: one line at the class, naming the fix. A server with fewer sessions than episodes at
    once, or whose reset raises: the episode cannot begin, one line with the server's reason and the fix. The
    server killed mid-episode: the next call is an error result at once, the episode cannot be scored (one line:
    never a silent 0), nor the next begin; never a hang."""
    with openenv_server(GUESS) as url:
        *full, env = handles(url, 9)  # the server takes 8 sessions at once
        for other in full:
            other.reset(secret=3)
        with pytest.raises(EnvironmentFailure, match="CAPACITY_REACHED: Server at capacity: 8/8 .*: raise it"):
            env.reset(secret=3)
        for other in full:
            other._close()
        with pytest.raises(EnvironmentFailure, match="reset failed, so the episode cannot begin: .*this row breaks"):
            env.reset(secret=3, fail=True)
        env.reset(secret=3)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the session with the server was lost: ConnectionClosed"):
        env.step(guess=3)
    with pytest.raises(EnvironmentFailure, match="get_reward failed, so the episode cannot be scored: .*lost mid"):
        env.get_reward()
    with pytest.raises(EnvironmentFailure, match="reset failed, so the episode cannot begin: .*Connection refused"):
        env.reset(secret=3)
    assert time.monotonic() - start < 10
    env._close()
    with pytest.raises(ConfigError, match=r"no OpenEnv server answers there \(\[Errno 111\] Connection refused\)"):
        served_class(url, 5.0)


def test_what_the_model_reads_of_an_observation():
    """An MCP result's text parts; else the observation's own fields: one text field as it is, several as JSON,
    none as nothing (done, reward and metadata are the protocol's, not the model's)."""
    from toolkit.training.served_environments import text

    content = [{"type": "text", "text": "3 apples"}, {"type": "image", "data": "..."}, {"type": "text", "text": "ok"}]
    assert text({"tool_name": "stock", "result": {"content": content}, "error": None}) == "3 apples\nok"
    assert text({"board": "x.o", "done": False, "reward": None, "metadata": {"turn": 2}}) == "x.o"
    assert text({"board": "x.o", "legal": [1, 2], "done": False}) == '{"board": "x.o", "legal": [1, 2]}'
    assert text({"score": 3}) == '{"score": 3}' and text({"done": True, "reward": 1.0, "metadata": {}}) is None
