"""`tokenmill serve` argument parsing: spellings, value formats, config files, help, not-yet-supported flags.

Fast: nothing here loads a model; parse results are checked on the returned kwargs dict and FrontendConfig.
"""
from __future__ import annotations

import json
import shlex

import pytest

from tokenmill import envs
from tokenmill.config.args import make_serve_parser, parse_serve_args
from tokenmill.config.engine_args import all_engine_arg_names
from tokenmill.config.frontend import FrontendConfig
from tokenmill.config.help_zh import HELP_ZH, wrap_wide

LOCALE_VARS = ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG")


@pytest.fixture(autouse=True)
def english_locale():
    with envs.override(**dict.fromkeys(LOCALE_VARS)):
        yield


def parse(cmd: str):
    return parse_serve_args(shlex.split(cmd))


def fails(cmd: str, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(cmd)
    assert exc.value.code == 2
    return capsys.readouterr().err


def help_text(cmd: str, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(cmd)
    assert exc.value.code == 0
    return capsys.readouterr().out


# ---- spellings and value formats -------------------------------------------------------------------------------

def test_nothing_given_means_empty_kwargs_and_default_frontend():
    engine, frontend = parse("")
    assert engine == {}
    assert frontend == FrontendConfig()
    assert frontend.port == 8000 and frontend.host is None and frontend.allowed_origins == ["*"]


def test_dashes_and_underscores_are_the_same_flag():
    a, _ = parse("--gpu-memory-utilization 0.7 --max-num-seqs 8")
    b, _ = parse("--gpu_memory_utilization 0.7 --max_num_seqs=8")
    assert a == b == {"gpu_memory_utilization": 0.7, "max_num_seqs": 8}
    _, fe = parse("--uvicorn_log_level debug --disable_uvicorn_access_log")
    assert fe.uvicorn_log_level == "debug" and fe.disable_uvicorn_access_log


def test_bool_flags_negation_and_explicit_values():
    engine, _ = parse("--no-enable-prefix-caching --enforce-eager true --trust-remote-code=false "
                      "--no_enable_chunked_prefill")
    assert engine == {"enable_prefix_caching": False, "enforce_eager": True, "trust_remote_code": False,
                      "enable_chunked_prefill": False}
    engine, _ = parse("--enable-prefix-caching --no-enforce-eager=false")
    assert engine == {"enable_prefix_caching": True, "enforce_eager": True}


def test_bool_flag_with_bad_value(capsys):
    assert "expected true or false" in fails("--enforce-eager=maybe", capsys)


def test_readable_numbers():
    engine, _ = parse("--max-model-len 32k --max-num-batched-tokens 8K --kv-cache-memory-bytes 4G")
    assert engine == {"max_model_len": 32000, "max_num_batched_tokens": 8192, "kv_cache_memory_bytes": 4 * 2**30}
    assert parse("--max-model-len 1K")[0]["max_model_len"] == 1024
    assert parse("--max-model-len 25.6k")[0]["max_model_len"] == 25600
    assert parse("--max-model-len auto")[0]["max_model_len"] is None
    assert parse("--max-model-len -1")[0]["max_model_len"] is None
    assert parse("--max-num-batched-tokens=-1")[0]["max_num_batched_tokens"] is None


def test_bad_numbers_name_the_flag(capsys):
    assert "--max-model-len" in fails("--max-model-len lots", capsys)
    assert "argument --port: invalid int value" in fails("--port http", capsys)


def test_short_aliases():
    engine, fe = parse("-tp 4 -pp 1 -dp 1 -q gguf -asc 1")
    assert engine == {"tensor_parallel_size": 4, "pipeline_parallel_size": 1, "data_parallel_size": 1,
                      "quantization": "gguf"}
    assert fe.api_server_count == 1


def test_choices_error_names_flag_and_allowed_values(capsys):
    err = fails("--dtype fp64", capsys)
    assert "argument --dtype" in err and "fp64" in err
    for allowed in ("auto", "half", "float16", "bfloat16", "float32"):
        assert repr(allowed) in err
    err = fails("--uvicorn-log-level loud", capsys)
    assert "--uvicorn-log-level" in err and "'warning'" in err and "'trace'" in err
    err = fails("--chat-template-content-format xml", capsys)
    assert "'openai'" in err and "'string'" in err


# ---- dicts and lists -------------------------------------------------------------------------------------------

def test_json_dict_argument():
    engine, fe = parse("""--hf-overrides '{"rope_theta": 1000000, "rope_scaling": {"factor": 2.0}}' """
                       """--default-chat-template-kwargs '{"enable_thinking": false}'""")
    assert engine["hf_overrides"] == {"rope_theta": 1000000, "rope_scaling": {"factor": 2.0}}
    assert fe.default_chat_template_kwargs == {"enable_thinking": False}


def test_dotted_keys_equal_json():
    dotted, _ = parse("--hf-overrides.key1 value1 --hf-overrides.key2.key3 value2")
    whole, _ = parse("""--hf-overrides '{"key1": "value1", "key2": {"key3": "value2"}}'""")
    assert dotted == whole
    # values are JSON when they parse as JSON; '=' works too; dotted keys merge into an earlier JSON value
    engine, _ = parse("""--hf-overrides '{"a": {"x": 1}}' --hf_overrides.a.y=2 --hf-overrides.flag true """
                      "--hf-overrides.name qwen")
    assert engine["hf_overrides"] == {"a": {"x": 1, "y": 2}, "flag": True, "name": "qwen"}


def test_dotted_list_append():
    plus, _ = parse("--hf-overrides.key4+ value3 --hf-overrides.key4+='value4,value5'")
    whole, _ = parse("""--hf-overrides '{"key4": ["value3", "value4", "value5"]}'""")
    assert plus == whole


def test_bad_json_and_dotted_misuse(capsys):
    assert "argument --hf-overrides: invalid JSON" in fails("--hf-overrides '{bad'", capsys)
    assert "expected a JSON object" in fails("--hf-overrides '[1, 2]'", capsys)
    assert "only with JSON options" in fails("--port.x 1", capsys)
    assert "expected a value" in fails("--hf-overrides.a", capsys)


def test_list_arguments_take_several_values_and_plus_appends():
    engine, fe = parse("--served-model-name a b --api-key k1 k2 --middleware m.one --middleware m.two "
                       """--allowed-origins '["https://x.example"]' --ignore-patterns+ '*.bin'""")
    assert engine["served_model_name"] == ["a", "b"]
    assert engine["ignore_patterns"] == ["original/**/*", "*.bin"]  # + appends to the default
    assert fe.api_key == ["k1", "k2"]
    assert fe.middleware == ["m.one", "m.two"]
    assert fe.allowed_origins == ["https://x.example"]
    engine, fe = parse("--ignore-patterns '*.pt' --allowed-methods+=GET,POST")
    assert engine["ignore_patterns"] == ["*.pt"]  # without + the list replaces the default
    assert fe.allowed_methods == ["*", "GET", "POST"]


# ---- model tag and --config ------------------------------------------------------------------------------------

def test_model_tag_is_model(capsys):
    assert parse("Qwen/Qwen3-8B")[0] == {"model": "Qwen/Qwen3-8B"}
    assert parse("--port 9000 Qwen/Qwen3-8B")[0] == {"model": "Qwen/Qwen3-8B"}
    assert parse("Qwen/Qwen3-8B --model Qwen/Qwen3-8B")[0] == {"model": "Qwen/Qwen3-8B"}
    assert "differ" in fails("Qwen/Qwen3-8B --model Qwen/Qwen3-4B", capsys)


def test_config_file_yaml_with_cli_precedence(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model: /models/a\nmax_model_len: 32k\ngpu-memory-utilization: 0.8\n"
                   "enable_prefix_caching: false\nport: 9000\napi_key: [k1]\n"
                   "hf_overrides: {a: 1, b: {c: 2}}\nallowed_origins: ['https://a.example']\n")
    engine, fe = parse(f"--config {cfg} --port 9001 --hf-overrides.b.d 3 --gpu_memory_utilization 0.5")
    assert engine == {"model": "/models/a", "max_model_len": 32000, "gpu_memory_utilization": 0.5,
                      "enable_prefix_caching": False, "hf_overrides": {"a": 1, "b": {"c": 2, "d": 3}}}
    assert fe.port == 9001 and fe.api_key == ["k1"] and fe.allowed_origins == ["https://a.example"]
    # a positional model on the command line wins over the file's model; list flags replace the file's list
    engine, fe = parse(f"/models/b --config={cfg} --api-key k2")
    assert engine["model"] == "/models/b" and fe.api_key == ["k2"]


def test_config_file_json(tmp_path):
    cfg = tmp_path / "serve.json"
    cfg.write_text(json.dumps({"max-num-seqs": 16, "enable_chunked_prefill": True, "reasoning_parser": "qwen3"}))
    engine, fe = parse(f"--config {cfg}")
    assert engine == {"max_num_seqs": 16, "enable_chunked_prefill": True}
    assert fe.reasoning_parser == "qwen3"


def test_config_file_errors(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_modle_len: 4096\n")
    err = fails(f"--config {bad}", capsys)
    assert "unknown option 'max_modle_len'" in err and "max-model-len" in err
    assert "cannot read config file" in fails(f"--config {tmp_path / 'missing.yaml'}", capsys)
    lst = tmp_path / "list.yaml"
    lst.write_text("- a\n- b\n")
    assert "mapping" in fails(f"--config {lst}", capsys)


# ---- not yet supported -----------------------------------------------------------------------------------------

def test_not_yet_supported_flags_fail_clearly(capsys):
    for cmd, said in (("--enable-tower-connector-lora", "`enable_tower_connector_lora=True` "
                       "(--enable-tower-connector-lora)"),
                      ("""--kv-transfer-config '{"kv_connector": "x"}'""", "(--kv-transfer-config)"),
                      ("--specialize-active-lora", "`specialize_active_lora=True` (--specialize-active-lora)"),
                      ("--kv-offloading-size 10", "(--kv-offloading-size)"),
                      ("--limit-mm-per-prompt.image 10", "(--limit-mm-per-prompt)")):
        assert f"{said} is not supported yet by tokenmill" in fails(cmd, capsys), cmd


def test_enable_sleep_mode_is_a_flag():
    """Sleep mode (LLM.sleep / wake_up, worker/sleep.py) is a ModelConfig field now, as in vLLM."""
    assert parse("--enable-sleep-mode")[0] == {"enable_sleep_mode": True}


def test_vllm_compilation_flags_parse():
    engine, _ = parse("-O3 -cc.cudagraph_capture_sizes 1 -cc.cudagraph_capture_sizes+ 2 -cc.mode 3")
    assert engine == {"optimization_level": 3, "compilation_config": {"cudagraph_capture_sizes": [1, 2], "mode": 3}}
    engine, _ = parse("""--compilation-config '{"cudagraph_mode": "FULL_DECODE_ONLY"}' -O0""")
    assert engine == {"compilation_config": {"cudagraph_mode": "FULL_DECODE_ONLY"}, "optimization_level": 0}


def test_not_yet_supported_flags_with_default_values_parse():
    engine, _ = parse("--no-enable-tower-connector-lora --runner generate --model-impl auto --task generate "
                      "--additional-config '{}' --preemption-mode recompute --attention-backend auto")
    assert engine == {}


def test_config_fields_validate_themselves(capsys):
    assert "tool_call_parser" in fails("--enable-auto-tool-choice", capsys)
    assert "port" in fails("--port 70000", capsys)
    assert "neither name=path nor a JSON object" in fails("--lora-modules name", capsys)
    assert "cannot be combined with uds" in fails("--api-server-count 2 --uds /tmp/tm.sock", capsys)


def test_unknown_flag_suggests(capsys):
    err = fails("--gpu-memory-utilisation 0.9", capsys)
    assert "unrecognized arguments" in err and "--gpu-memory-utilization" in err


def test_legacy_vllm_flags():
    _, fe = parse("--disable-log-requests")
    assert fe.enable_log_requests is False
    _, fe = parse("--enable-reasoning --reasoning-parser deepseek_r1")
    assert fe.reasoning_parser == "deepseek_r1"


# ---- commands from the seeds -----------------------------------------------------------------------------------

def test_seed_qwen25_72b_command():
    engine, fe = parse(
        "Qwen/Qwen2.5-72B-Instruct --host 0.0.0.0 --port 8000 --gpu-memory-utilization 0.90 --max-model-len 32768 "
        "--max-num-seqs 256 --dtype auto --enforce-eager --enable-prefix-caching --enable-chunked-prefill "
        "--max-num-batched-tokens 32768 --api-key sk-xxx --served-model-name qwen2.5-72b --trust-remote-code "
        "--disable-log-stats --uvicorn-log-level warning --disable-uvicorn-access-log")
    assert engine == {"model": "Qwen/Qwen2.5-72B-Instruct", "gpu_memory_utilization": 0.9, "max_model_len": 32768,
                      "max_num_seqs": 256, "dtype": "auto", "enforce_eager": True, "enable_prefix_caching": True,
                      "enable_chunked_prefill": True, "max_num_batched_tokens": 32768,
                      "served_model_name": ["qwen2.5-72b"], "trust_remote_code": True}
    assert (fe.host, fe.port, fe.api_key) == ("0.0.0.0", 8000, ["sk-xxx"])
    assert fe.disable_log_stats and fe.disable_uvicorn_access_log and fe.uvicorn_log_level == "warning"
    assert set(engine) <= set(all_engine_arg_names())


def test_seed_deepseek_r1_distill_command():
    engine, fe = parse("--model /models/DeepSeek-R1-Distill-Qwen-7B --served-model-name DeepSeekR1 --host 0.0.0.0 "
                       "--port 8000 --dtype float16 --gpu_memory_utilization 0.7")
    assert engine == {"model": "/models/DeepSeek-R1-Distill-Qwen-7B", "served_model_name": ["DeepSeekR1"],
                      "dtype": "float16", "gpu_memory_utilization": 0.7}
    assert fe.host == "0.0.0.0" and fe.port == 8000


def test_seed_qwen3_template_command():
    engine, fe = parse(
        "--dtype bfloat16 --max-model-len 32768 --max-num-batched-tokens 8192 --max-num-seqs 16 "
        "--enable-chunked-prefill --enable-prefix-caching "
        """--default-chat-template-kwargs '{"enable_thinking": false}' --reasoning-parser qwen3 """
        "--enable-auto-tool-choice --tool-call-parser qwen3_coder --trust-remote-code")
    assert engine == {"dtype": "bfloat16", "max_model_len": 32768, "max_num_batched_tokens": 8192,
                      "max_num_seqs": 16, "enable_chunked_prefill": True, "enable_prefix_caching": True,
                      "trust_remote_code": True}
    assert fe.default_chat_template_kwargs == {"enable_thinking": False}
    assert (fe.reasoning_parser, fe.tool_call_parser, fe.enable_auto_tool_choice) == ("qwen3", "qwen3_coder", True)


def test_tensor_parallel_parses():
    assert parse("--tensor-parallel-size 4")[0] == {"tensor_parallel_size": 4}


# ---- help ------------------------------------------------------------------------------------------------------

def test_help_overview_lists_groups(capsys):
    out = help_text("--help", capsys)
    assert out.startswith("usage: tokenmill serve")
    for group in ("ModelConfig", "CacheConfig", "SchedulerConfig", "LoadConfig", "ParallelConfig", "DeviceConfig",
                  "FrontendConfig", "NotYetSupported"):
        assert group in out
    assert "--help=all" in out and "--help=max-model-len" in out
    assert "--gpu-memory-utilization" not in out  # the overview stays short
    assert help_text("-h", capsys) == out


def test_help_group_is_case_insensitive(capsys):
    out = help_text("--help=CacheConfig", capsys)
    assert "--gpu-memory-utilization" in out and "--block-size" in out
    assert "--max-model-len" not in out
    assert help_text("--help=cacheconfig", capsys) == out


def test_help_one_flag_either_spelling(capsys):
    out = help_text("--help=max-model-len", capsys)
    assert "--max-model-len" in out and "32k" in out
    assert "--max-num-seqs" not in out
    assert help_text("--help=max_model_len", capsys) == out
    assert "--tensor-parallel-size" in help_text("--help=tp", capsys)


def test_help_search_lists_matching_flags(capsys):
    out = help_text("--help=max", capsys)
    for flag in ("--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--max-log-len"):
        assert flag in out
    assert "--block-size" not in out
    assert "no option or group matches" in fails("--help=zzzz", capsys)


def test_help_all(capsys):
    out = help_text("--help=all", capsys)
    for flag in ("--max-model-len", "--block-size", "--max-num-seqs", "--load-format", "--tensor-parallel-size",
                 "--device", "--api-key", "--enable-lora", "--config", "--no-enable-prefix-caching"):
        assert flag in out
    assert "[not supported yet]" in out and "(default: 0.92)" in out


def test_help_in_chinese_via_flag(capsys):
    out = help_text("--help=CacheConfig --help-lang zh", capsys)
    assert "CacheConfig（KV 缓存）" in out and HELP_ZH["block_size"] in out.replace("\n", "")
    assert "默认值" in out
    overview = help_text("--help-lang=zh -h", capsys)
    assert overview.startswith("用法：") and "选项分组" in overview


def test_help_in_chinese_via_locale(capsys):
    with envs.override(LANG="zh_CN.UTF-8"):
        assert "上下文长度" in help_text("--help=max-model-len", capsys)
        assert "Context length" in help_text("--help=max-model-len --help-lang en", capsys)


def test_chinese_help_wraps_by_display_width():
    lines = wrap_wide(HELP_ZH["gpu_memory_utilization"], 40)
    assert len(lines) > 2
    assert all(sum(2 if ord(c) > 0x2e80 else 1 for c in line) <= 40 for line in lines)
    assert not any(line[0] in "，。；：）" for line in lines)


def test_parser_is_reusable_with_parse_args():
    parser = make_serve_parser()
    ns = parser.parse_args(["m", "--max-model-len", "4k", "--port", "1234"])
    assert vars(ns) == {"model": "m", "max_model_len": 4000, "port": 1234}
