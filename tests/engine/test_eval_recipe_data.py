"""The recipe's held-out data: ``data.eval_sessions`` loads whole sessions apart from ``data.sessions``."""

from __future__ import annotations

import pytest

from recipes.monarch.config import DataConfig, load_config
from recipes.monarch.data import eval_session_files, load_data, load_eval_states, load_states, session_files


def test_presets_train_on_the_train_split_and_evaluate_on_heldout_sessions():
    for preset in ("single_node", "tiny", "gpu_single_node"):
        cfg = load_config(preset)
        train, held = session_files(cfg), eval_session_files(cfg)
        assert {f.parent.name for f in train} == {"train"} and {f.parent.name for f in held} == {"heldout"}
        assert len(held) >= 8 and not set(train) & set(held)
    cfg = load_config("single_node", ["data.max_eval_states=24"])
    states, held = load_states(cfg), load_eval_states(cfg)
    assert len(held) == cfg.data.max_eval_states == 24
    assert len({s["state_id"].split("::")[0] for s in held}) >= 8  # spread over the held-out sessions
    assert not {s["state_id"] for s in held} & {s["state_id"] for s in states}
    assert held == load_eval_states(cfg)  # the same states in every run
    everything = load_eval_states(load_config("single_node"))  # the default preset evaluates on all of them
    assert load_config("single_node").data.max_eval_states == 0 and len(everything) == 78
    assert not {s["state_id"] for s in everything} & {s["state_id"] for s in states}


def test_eval_sessions_errors_name_the_key_and_the_fix():
    # one check of the held-out split (engine.data.heldout_split), run on the controller before any spawn
    everything = load_config("tiny", ["data.sessions=[bundled:sessions/*/*.jsonl]", "data.max_states=100000",
                                      "data.max_eval_states=0"])
    with pytest.raises(ValueError, match="also training ones.*keep data.eval_sessions and data.sessions"):
        load_data(everything)
    with pytest.raises(ValueError, match="'data.eval_sessions' entry .* matches no file"):
        load_config("tiny", ["data.eval_sessions=[no/such/*.jsonl]"])
    with pytest.raises(ValueError, match=r"not both; .*data.eval_sessions=\[\]"):
        load_data(load_config("tiny", ["data.num_eval_prompts=2"]))
    with pytest.raises(ValueError, match="'data.max_eval_states' must be an integer in .0, "):
        DataConfig(max_eval_states=-1)
    with pytest.raises(ValueError, match="'data.eval_max_new_tokens' must be an integer in .1, "):
        DataConfig(eval_max_new_tokens=0)
    assert load_eval_states(load_config("tiny", ["data.eval_sessions=[]"])) == []
