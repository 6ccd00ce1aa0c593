"""--speculative-config / LLM(speculative_config=...): parsed as vLLM 0.20 reads it, bad input refused by key."""
from __future__ import annotations

import shlex

import pytest

from tokenmill.config.args import parse_serve_args
from tokenmill.config.engine_args import create_engine_config
from tokenmill.config.speculative import SpeculativeConfig


def test_cli_json_and_dotted_keys_and_dict_give_the_same_config():
    a, _ = parse_serve_args(shlex.split("""m --speculative-config '{"method": "ngram", "num_speculative_tokens": 3,
                                        "prompt_lookup_max": 4}'"""))
    b, _ = parse_serve_args(shlex.split("m -sc.method ngram -sc.num_speculative_tokens 3 -sc.prompt_lookup_max 4"))
    assert a["speculative_config"] == b["speculative_config"]
    cfg = SpeculativeConfig.from_value(a["speculative_config"])
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 3, 1, 4)
    assert SpeculativeConfig.from_value('{"model": "ngram", "num_speculative_tokens": 2}').method == "ngram"
    assert SpeculativeConfig.from_value(None) is None


def test_engine_config_carries_it():
    c = create_engine_config(speculative_config={"method": "suffix", "num_speculative_tokens": 5})
    # on the CPU async scheduling stays off by default; asked for, it overlaps the steps decoded without drafts
    assert c.speculative_config.method == "suffix" and c.scheduler_config.async_scheduling is False
    assert c.speculative_config.step_aside is True
    assert create_engine_config().speculative_config is None
    c = create_engine_config(speculative_config={"method": "ngram", "num_speculative_tokens": 2, "step_aside": False},
                             async_scheduling=True)
    assert c.scheduler_config.async_scheduling is True and c.speculative_config.step_aside is False


@pytest.mark.parametrize("value, said", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "`num_speculative_tokens` must be an integer in 1..16"),
    ({"method": "ngram", "num_speculative_tokens": 2, "step_aside": "yes"}, "`step_aside` must be true or false"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "`num_speculative_tokens` must be an integer in 1..16"),
    ({"method": "ngram"}, "`num_speculative_tokens` is required"),
    ({"method": "nonsense", "num_speculative_tokens": 2}, "unknown `method` 'nonsense'"),
    ({"num_speculative_tokens": 2}, "`method` is required"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "unknown key(s) 'lookup'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "`prompt_lookup_min` (5) is larger than `prompt_lookup_max` (2)"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "method eagle3 needs `model`, the EAGLE head's directory"),
    ({"model": "/path/to/draft", "num_speculative_tokens": 2}, "the draft `model` '/path/to/draft' cannot be used"),
    ({"model": "/path/to/EAGLE3-LLaMA3.1-8B", "num_speculative_tokens": 2},
     "the eagle3 head `model` '/path/to/EAGLE3-LLaMA3.1-8B' cannot be used"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "method `mtp` is not built yet"),
    ("{not json", "--speculative-config: not valid JSON"),
])
def test_bad_values_are_refused_naming_the_key(value, said):
    with pytest.raises(ValueError) as e:
        create_engine_config(speculative_config=value)
    assert said in str(e.value)


def test_bad_json_on_the_command_line_is_a_parse_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(["m", "--speculative-config", "{nope"])
    assert "--speculative-config" in capsys.readouterr().err


@pytest.mark.parametrize("argv, name", [
    ("--speculative-model /d", "speculative_model"), ("--num-speculative-tokens 4", "num_speculative_tokens"),
    ("--ngram-prompt-lookup-max 4", "ngram_prompt_lookup_max"),
    ("--speculative-disable-by-batch-size 8", "speculative_disable_by_batch_size")])
def test_old_vllm_flags_are_refused_with_the_speculative_config_line(argv, name, capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(["m", *shlex.split(argv)])
    err = capsys.readouterr().err
    assert f"(--{name.replace('_', '-')}) is a vLLM 0.7 option" in err and "use --speculative-config '{" in err
