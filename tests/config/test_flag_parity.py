"""Every accepted flag works or is refused, and `tokenmill serve`, `LLM(...)` and `EngineArgs` accept the same
engine arguments and refuse the same ones with the same message (config/unsupported.py holds the one table)."""
from __future__ import annotations

import json
import shlex

import pytest

from tokenmill.config.args import make_serve_parser, parse_serve_args
from tokenmill.config.engine_args import EngineArgs, create_engine_config
from tokenmill.config.unsupported import NOT_YET_SUPPORTED
from tokenmill.entrypoints.llm import LLM


def cli_error(argv: list[str], capsys) -> str:
    """The message `tokenmill serve ARGV` stops with: at parse time, or when the engine config is built."""
    try:
        engine, _ = parse_serve_args(argv)
    except SystemExit as e:
        assert e.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1].split("error: ", 1)[1]
    with pytest.raises(ValueError) as e:
        create_engine_config(**engine)
    return str(e.value)


def api_errors(kwargs: dict) -> tuple[str, str]:
    """The messages of LLM(**kwargs) and EngineArgs(**kwargs).create_engine_config()."""
    with pytest.raises(ValueError) as llm:
        LLM(**kwargs)
    with pytest.raises(ValueError) as args:
        EngineArgs(**kwargs).create_engine_config()
    return str(llm.value), str(args.value)


def _refused_value(name: str):
    """(command-line tokens, Python value) of a value the table refuses for `name`."""
    nys = NOT_YET_SUPPORTED[name]
    flag = "--" + name.replace("_", "-")
    if nys.kind == "bool":
        if (not nys.default) in nys.accepted:
            pytest.skip(f"{name}: both values describe what tokenmill does")
        return ([flag] if nys.default is not True else ["--no-" + flag[2:]]), nys.default is not True
    value = {"int": 7, "float": 1.5, "str": "x", "list": [7] if name == "numa_bind_nodes" else ["x"],
             "json": {"x": 1}}[nys.kind]
    text = json.dumps(value) if nys.kind == "json" else " ".join(map(str, value)) if nys.kind == "list" else str(value)
    return [flag, text], value


@pytest.mark.parametrize("name", sorted(NOT_YET_SUPPORTED))
def test_every_not_yet_supported_option_is_refused_alike_everywhere(name, capsys):
    argv, value = _refused_value(name)
    said = cli_error(argv, capsys)
    if NOT_YET_SUPPORTED[name].instead:  # an old vLLM spelling: the message names the one to use
        assert said.startswith(f"`{name}={value!r}` (--{name.replace('_', '-')}) is a vLLM 0.7 option")
        assert said.endswith(f"use {NOT_YET_SUPPORTED[name].instead} instead.")
    else:
        assert said.startswith(f"`{name}={value!r}` (--{name.replace('_', '-')}) is not supported yet by tokenmill.")
    if NOT_YET_SUPPORTED[name].frontend:  # an API-server flag: not an engine argument, in vLLM either
        with pytest.raises(TypeError, match=f"Unknown engine argument `{name}`"):
            LLM(**{name: value})
    else:
        assert api_errors({name: value}) == (said, said)


def test_lora_and_speculative_decoding_same_message_on_cli_and_llm(capsys):
    for argv, kwargs in ((["--enable-tower-connector-lora"], {"enable_tower_connector_lora": True}),
                         (shlex.split("--speculative-config.method mtp "
                                      "--speculative-config.num_speculative_tokens 3"),
                          {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}})):
        said = cli_error(argv, capsys)
        assert api_errors(kwargs) == (said, said)
        assert "is not supported yet by tokenmill" in said


def test_accepted_values_pass_on_both_paths_and_change_nothing():
    engine, _ = parse_serve_args(shlex.split("--no-enable-tower-connector-lora --runner generate"))
    assert engine == {}
    args = EngineArgs(enable_tower_connector_lora=False, runner="generate", speculative_config=None, hf_token=False)
    assert args.enable_tower_connector_lora is False and EngineArgs().max_lora_rank == 16  # unset: the default
    assert args.create_engine_config() == create_engine_config()


def test_unknown_names_are_still_unknown_with_suggestions():
    with pytest.raises(TypeError, match="Unknown engine argument `enable_loraa`.*Did you mean: enable_lora"):
        EngineArgs(enable_loraa=True)


# ---- flags that do what vLLM does, or nothing where vLLM does nothing -----------------------------------------

@pytest.mark.parametrize("flag, field, values", [
    ("--max-num-partial-prefills", "max_num_partial_prefills", (2, 4)),
    ("--max-long-partial-prefills", "max_long_partial_prefills", (2,)),
])
def test_concurrent_partial_prefill_caps_are_refused_above_1(flag, field, values, capsys):
    assert parse_serve_args([flag, "1"])[0] == {field: 1}
    create_engine_config(**{field: 1})
    for v in values:
        said = cli_error([flag, str(v)], capsys)
        assert said.startswith(f"`{field}={v}` ({flag}) is not supported yet by tokenmill.")
        assert api_errors({field: v}) == (said, said)
    with pytest.raises(ValueError, match=f"Invalid value 0 for `{field}`"):
        create_engine_config(**{field: 0})


@pytest.mark.parametrize("flag, field, choices", [
    ("--mm-processor-cache-type", "mm_processor_cache_type", ("lru", "shm")),
    ("--mm-encoder-tp-mode", "mm_encoder_tp_mode", ("weights", "data")),
])
def test_multimodal_options_parse_with_vllms_choices_and_are_no_ops_for_text_models(flag, field, choices, capsys):
    base = create_engine_config()
    for choice in choices:
        assert parse_serve_args([flag, choice])[0] == {field: choice}
        cfg = create_engine_config(**{field: choice})
        assert getattr(cfg.model_config, field) == choice
        assert cfg.scheduler_config == base.scheduler_config and cfg.cache_config == base.cache_config
    assert "invalid choice" in cli_error([flag, "nope"], capsys)
    with pytest.raises(ValueError, match=f"Invalid value 'nope' for `{field}`"):
        LLM(**{field: "nope"})


@pytest.mark.parametrize("argv, field", [(["--no-disable-cascade-attn"], "disable_cascade_attn"),
                                         (["--disable-chunked-mm-input"], "disable_chunked_mm_input")])
def test_documented_no_op_flags_parse_and_their_help_says_so(argv, field):
    engine, _ = parse_serve_args(argv)
    cfg = create_engine_config(**engine)
    assert engine[field] == (argv[0] != "--no-disable-cascade-attn")
    owner = cfg.model_config if hasattr(cfg.model_config, field) else cfg.scheduler_config
    assert getattr(owner, field) == engine[field]
    spec = next(s for s in make_serve_parser(lang="en").specs if s.dest == field)
    assert "no effect" in spec.help.lower()


def test_swap_space_is_checked_against_host_memory_as_in_vllm(capsys):
    import os
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    assert create_engine_config(swap_space=0).cache_config.swap_space == 0
    too_big = int(host_gib) + 1
    said = cli_error(["--swap-space", str(too_big)], capsys)
    assert f"swap_space={too_big} GiB" in said and "Lower --swap-space" in said
    assert api_errors({"swap_space": too_big}) == (said, said)
    with pytest.raises(ValueError, match="Invalid value -1 for `swap_space`"):
        create_engine_config(swap_space=-1)


def test_tokenizer_mode_has_vllms_choices_and_refuses_the_ones_it_lacks_by_name(capsys):
    spec = next(s for s in make_serve_parser(lang="en").specs if s.dest == "tokenizer_mode")
    assert set(spec.choices) == {"auto", "deepseek_v32", "deepseek_v4", "hf", "mistral", "slow"}  # vLLM 0.20.1
    for mode in ("mistral", "deepseek_v32", "deepseek_v4"):
        said = cli_error(["--tokenizer-mode", mode], capsys)
        assert said.startswith(f"`tokenizer_mode='{mode}'` (--tokenizer-mode) is not supported yet by tokenmill.")
        assert api_errors({"tokenizer_mode": mode}) == (said, said)
