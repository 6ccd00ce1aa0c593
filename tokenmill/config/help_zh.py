"""Help for `tokenmill serve`: the Chinese texts (data, below) and the renderer behind `--help=...`.

The renderer lives here because Chinese help needs width-aware wrapping: a CJK character takes two terminal
columns and there are no spaces to break at, which argparse's textwrap-based formatter does not know.
Keys of HELP_ZH are option names with underscores (the dataclass field names).
"""
from __future__ import annotations

import argparse
import difflib
import os
import re
import unicodedata

from tokenmill import envs

# ---- rendering ------------------------------------------------------------------------------------------------

_NO_LINE_START = set("，。、；：？！）》」』】,.;:?!)")
_TOKEN = re.compile(r"[\u2e80-\u9fff\uf900-\ufaff\uff00-\uffef\u3000-\u303f]|[^\s\u2e80-\u9fff\uf900-\ufaff"
                    r"\uff00-\uffef\u3000-\u303f]+|\s+")


def _cols(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)


def wrap_wide(text: str, width: int) -> list[str]:
    """Wrap at spaces or between CJK characters so that no line is wider than `width` terminal columns."""
    width = max(width, 10)
    lines: list[str] = []
    line, used = "", 0
    for tok in _TOKEN.findall(" ".join(text.split())):
        if tok.isspace():
            if line and used < width:
                line, used = line + " ", used + 1
            continue
        cols = _cols(tok)
        if used + cols > width and line.strip():
            carry = ""
            if tok in _NO_LINE_START:  # punctuation may not open a line: take the character before it along
                if _cols(line[-1]) != 2 or len(line.strip()) < 2:
                    line, used = line + tok, used + cols
                    continue
                line, carry = line[:-1], line[-1]
            lines.append(line.rstrip())
            line, used = carry, _cols(carry)
        line, used = line + tok, used + cols
    if line.strip():
        lines.append(line.rstrip())
    return lines


class HelpFormatter(argparse.HelpFormatter):
    """argparse's formatter with CJK-aware wrapping."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=34)

    def _split_lines(self, text: str, width: int) -> list[str]:
        return wrap_wide(text, width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(indent + line for line in wrap_wide(text, width - len(indent)))


UI = {
    "en": {"default": "(default: {})", "nys": "[not supported yet]", "usage": "usage: {prog} [model_tag] [options]",
           "intro": "Start an OpenAI-compatible API server for a model. Options come from the config dataclasses "
                    "below; names and defaults follow `vllm serve`.",
           "groups": "Option groups (show one with --help=<group>):", "more": "More help:",
           "all": "every option", "group": "one group, e.g. --help=CacheConfig",
           "flag": "one option, e.g. --help=max-model-len", "search": "options whose name contains the text, "
                                                                      "e.g. --help=max",
           "lang": "language of the help (default: from LANG / LC_ALL / LANGUAGE)",
           "matches": "Options matching {!r}:", "no_match": "no option or group matches {!r}"},
    "zh": {"default": "（默认值：{}）", "nys": "【暂不支持】", "usage": "用法：{prog} [model_tag] [选项]",
           "intro": "为一个模型启动兼容 OpenAI 的 API 服务。选项由下列配置类生成，名称和默认值与 `vllm serve` 一致。",
           "groups": "选项分组（用 --help=<分组名> 查看某一组）：", "more": "更多帮助：",
           "all": "列出全部选项", "group": "只看一组，例如 --help=CacheConfig",
           "flag": "只看一个选项，例如 --help=max-model-len", "search": "列出名称中含有该文字的选项，例如 --help=max",
           "lang": "帮助的语言（默认随 LANG / LC_ALL / LANGUAGE）",
           "matches": "名称中含有 {!r} 的选项：", "no_match": "没有与 {!r} 匹配的选项或分组"},
}


def ui_text(lang: str, key: str) -> str:
    return UI.get(lang, UI["en"])[key]


def help_language(explicit: str | None = None) -> str:
    """'zh' or 'en': the explicit choice, else Chinese when the locale variables name a zh locale."""
    if explicit:
        return explicit
    for var in ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        if (getattr(envs, var) or "").lower().startswith("zh"):
            return "zh"
    return "en"


GROUP_DOCS_EN = {
    "General": "Where options come from, and help.",
    "ModelConfig": "The model to run: path, dtype, context length. Models are only looked up locally, never "
                   "downloaded.",
    "CacheConfig": "Layout and size of the paged KV cache.",
    "SchedulerConfig": "The per-step token budget and batching policy; prefill chunks and decodes share one budget.",
    "LoadConfig": "Where weights are read from, and in which format.",
    "ParallelConfig": "How the model is spread over devices: tensor and pipeline parallelism (local processes, "
                      "torchrun or a Ray cluster) and data parallelism (engine replicas).",
    "DeviceConfig": "Which device runs the model.",
    "CompilationConfig": "CUDA graphs for decode steps and small mixed batches (GPU only).",
    "SpeculativeArgs": "Speculative decoding: drafts proposed per request and verified in one forward.",
    "LoRAConfig": "LoRA adapters served next to the base model: batch slots, host cache, ranks and targets.",
    "FrontendConfig": "The OpenAI-compatible HTTP server: socket, CORS, authentication, TLS, chat templates, tools "
                      "and logging.",
    "NotYetSupported": "vLLM options that tokenmill accepts only with their default value, so existing command "
                       "lines parse; any other value is an error, never silently ignored.",
}


def group_doc(group: str, zh: bool, fallback: str = "") -> str:
    """One-line description of an option group (a config class, General or NotYetSupported); `fallback` (the
    config class's own first docstring line) for a group without a text here."""
    if zh and group in GROUP_DOCS_ZH:
        return GROUP_DOCS_ZH[group]
    return GROUP_DOCS_EN.get(group, fallback)


def _sections(parser: argparse.ArgumentParser, pairs: list) -> str:
    fmt = parser._get_formatter()
    for group, actions in pairs:
        fmt.start_section(group.title)
        fmt.add_text(group.description)
        fmt.add_arguments(actions)
        fmt.end_section()
    return fmt.format_help()


def _names(action: argparse.Action) -> list[str]:
    return [s.lstrip("-").lower() for s in action.option_strings] or [action.dest.replace("_", "-")]


def render_help(parser, topic: str | None) -> tuple[str, bool]:
    """Help text for `--help[=topic]`: (text, found). topic None = overview; 'all'; a group; an option; a search."""
    lang, groups = parser.lang, parser.groups
    visible = {name: [a for a in g._group_actions if a.help is not argparse.SUPPRESS] for name, g in groups.items()}
    usage = ui_text(lang, "usage").format(prog=parser.prog)
    if topic is None:
        width = max(len(n) for n in groups) + 4
        cols = max(os.get_terminal_size().columns if os.isatty(1) else 100, 60) - width - 2
        lines = [usage, "", *wrap_wide(ui_text(lang, "intro"), cols + width), "", ui_text(lang, "groups")]
        for name, group in groups.items():
            doc = wrap_wide(group.description or "", cols) or [""]
            lines.append(f"  {name:<{width}}{doc[0]}")
            lines += [" " * (width + 2) + rest for rest in doc[1:]]
        lines += ["", ui_text(lang, "more")]
        for flag, key in (("--help=all", "all"), ("--help=<group>", "group"), ("--help=<option>", "flag"),
                          ("--help=<text>", "search"), ("--help-lang zh|en", "lang")):
            lines.append(f"  {flag:<{width}}{ui_text(lang, key)}")
        return "\n".join(lines) + "\n", True
    key = topic.strip().lstrip("-").lower()
    if key == "all":
        return usage + "\n\n" + _sections(parser, [(g, visible[n]) for n, g in groups.items()]), True
    for name, group in groups.items():
        if name.lower() == key:
            return usage + "\n\n" + _sections(parser, [(group, visible[name])]), True
    key = key.replace("_", "-")
    for exact in (True, False):
        pairs = [(groups[n], [a for a in acts if (key in _names(a) if exact else any(key in s for s in _names(a)))])
                 for n, acts in visible.items()]
        pairs = [(g, acts) for g, acts in pairs if acts]
        if pairs:
            head = "" if exact else ui_text(lang, "matches").format(topic) + "\n\n"
            return head + _sections(parser, pairs), True
    known = [s for acts in visible.values() for a in acts for s in _names(a)] + [n.lower() for n in groups]
    close = difflib.get_close_matches(key, known, n=3)
    hint = f" (did you mean: {', '.join(close)}?)" if close else ""
    return ui_text(lang, "no_match").format(topic) + hint, False


# ---- data -----------------------------------------------------------------------------------------------------

GROUP_TITLES_ZH = {
    "General": "General（通用）",
    "ModelConfig": "ModelConfig（模型）",
    "CacheConfig": "CacheConfig（KV 缓存）",
    "SchedulerConfig": "SchedulerConfig（调度器）",
    "LoadConfig": "LoadConfig（权重加载）",
    "ParallelConfig": "ParallelConfig（并行）",
    "DeviceConfig": "DeviceConfig（设备）",
    "CompilationConfig": "CompilationConfig（CUDA Graph）",
    "SpeculativeArgs": "SpeculativeArgs（推测解码）",
    "LoRAConfig": "LoRAConfig（LoRA 适配器）",
    "FrontendConfig": "FrontendConfig（API 服务前端）",
    "NotYetSupported": "NotYetSupported（暂不支持的 vLLM 选项）",
}

GROUP_DOCS_ZH = {
    "General": "配置从哪里来，以及如何查看帮助。",
    "ModelConfig": "要运行的模型：路径、数据类型、上下文长度等。启动时只在本地查找模型，不会联网下载。",
    "CacheConfig": "分页 KV 缓存的布局和容量。",
    "SchedulerConfig": "每一步的 token 预算与批处理策略：预填充分块和解码共享同一份预算。",
    "LoadConfig": "权重从哪里读、以什么格式读。",
    "ParallelConfig": "模型如何分布到多个设备上：张量并行、流水线并行（本机多进程、torchrun 或 Ray 集群）与数据并行"
                      "（多个引擎副本）。",
    "DeviceConfig": "用哪种设备运行模型。",
    "CompilationConfig": "解码步骤与小型混合批使用的 CUDA Graph（仅 GPU）。",
    "SpeculativeArgs": "推测解码：每个请求先起草若干 token，再用一次前向一并验证。",
    "LoRAConfig": "与基础模型一同提供服务的 LoRA 适配器：批内槽位、主机内存缓存、秩与作用模块。",
    "FrontendConfig": "兼容 OpenAI 的 HTTP 服务：监听地址、跨域、鉴权、TLS、聊天模板、工具调用与日志。",
    "NotYetSupported": "tokenmill 还做不到的 vLLM 选项：为了让现有命令行能直接解析，这些选项可以写，但只能取默认值；"
                       "写成其他值会直接报错，而不是悄悄忽略。",
}

HELP_ZH: dict[str, str] = {
    # General
    "model_tag": "要部署的模型，等同于 --model。两者都写且不一致时报错。",
    "config": "从 YAML 或 JSON 文件读取选项；键名用下划线或连字符均可。命令行上写的选项优先于文件中的同名项。",
    "help": "查看帮助：--help=all 列出全部选项，--help=<分组名> 查看一组（如 CacheConfig），--help=<选项名> 查看单个"
            "选项（如 max-model-len），其他文字则按名称搜索（如 --help=max）。",
    "help_lang": "帮助文字的语言：zh 或 en。不指定时，若 LANG、LC_ALL 或 LANGUAGE 以 zh 开头则显示中文。",
    # ModelConfig
    "model": "模型目录、.gguf 文件，或本地 Hugging Face 缓存中已有的仓库名。不填则使用内置的 SmolLM2-135M-Instruct。",
    "tokenizer": "分词器的目录或仓库名；默认与模型相同。",
    "tokenizer_mode": "分词器模式：auto 和 hf 使用快速分词器，slow 使用 Python 实现的慢速分词器。mistral 与 "
                      "deepseek_v32 暂不支持。",
    "trust_remote_code": "允许执行模型仓库自带的 Python 代码（自定义模型结构或分词器时需要）。只对可信的模型开启。",
    "dtype": "权重和激活的数据类型。auto：GPU 上沿用检查点的精度（FP32 检查点按 BF16 运行），CPU 上用 float32。"
             "half 与 float16 相同，float 与 float32 相同；显卡不支持 bfloat16 时改用 float16。",
    "seed": "全局随机种子；没有指定 seed 的请求会从它派生出各自的种子，便于复现结果。",
    "revision": "使用本地 HF 缓存中模型的哪个版本（分支、标签或提交哈希）。",
    "code_revision": "模型的 config.json 从另一个 Hub 仓库引用远程配置代码时（auto_map 写成 'org/repo--模块.类'），"
                     "该代码使用的版本（分支、标签或提交哈希），在本地 HF 缓存中查找。与 vLLM 一样只在开启 "
                     "--trust-remote-code 时读取；不开启时不会执行任何远程代码，此项不起作用。",
    "tokenizer_revision": "使用本地 HF 缓存中分词器的哪个版本。",
    "hf_config_path": "从这个路径读取 HF 的 config.json，而不是从模型目录读取。",
    "max_model_len": "上下文长度上限（提示词加生成内容的 token 总数）；默认取模型配置中的最大长度，不能超过它。"
                     "支持易读写法：32k 表示 32000，1K 表示 1024（小写按 1000 进位，大写按 1024 进位），auto 或 -1 "
                     "表示用默认值。调小它可以省下显存、容纳更多并发。",
    "quantization": "权重量化方法（简写 -q）；默认取检查点的 quantization_config。fp8（FP8 检查点，或在加载时量化"
                    "稠密检查点）、compressed-tensors、awq、gptq、bitsandbytes（加载时把稠密检查点量化为 NF4）；"
                    "接受 vLLM 的别名（compressed_tensors、"
                    "awq_marlin、gptq_marlin）；GGUF 文件在加载时反量化。"
                    "指定与检查点不同的方法会报错。",
    "enforce_eager": "始终以 eager 模式执行，不使用 CUDA Graph。可以省下图捕获占用的显存、缩短启动时间，但解码会变慢。",
    "max_logprobs": "单个请求最多能要求返回多少个 logprobs；-1 表示不限制（可能占用大量内存）。",
    "logprobs_mode": "logprobs 中报告的内容：raw_logprobs / raw_logits 是任何处理之前的原始值，processed_logprobs / "
                     "processed_logits 是经过温度、top-k/top-p、惩罚项等处理之后的值。",
    "disable_sliding_window": "以全注意力运行滑动窗口模型，上下文上限随之变为窗口大小（与 vLLM 一致）；不开启时，这类"
                              "模型的 max_model_len 不能超过窗口。",
    "skip_tokenizer_init": "不加载分词器；此时请求必须直接给出 token ID，输出也只有 token ID。",
    "served_model_name": "API 中对外使用的模型名，可以给多个，服务会响应其中任意一个，响应里的 model 字段取第一个。"
                         "默认与 --model 相同。",
    "hf_overrides": "合并进 HF 模型配置的键值，JSON 格式，例如 '{\"rope_theta\": 1000000}'；也可以用 "
                    "--hf-overrides.rope_theta 1000000 逐项指定。",
    "generation_config": "生成参数的默认值从哪里来：auto 读取模型自带的 generation_config.json，vllm 表示不读取，"
                         "也可以给一个包含该文件的目录。",
    "override_generation_config": "覆盖生成参数的默认值，JSON 格式，例如 '{\"temperature\": 0.5}'；与 "
                                  "--generation-config auto 同用时会与模型自带的默认值合并。",
    "disable_cascade_attn": "可以写任一取值，但不起作用：级联注意力（vLLM 的 FlashAttention 后端可能选用的一种共享"
                            "前缀拆分）不是 tokenmill 注意力后端的功能；vLLM 的其他后端同样忽略这个选项。",
    "mm_processor_cache_type": "多模态输入预处理结果的缓存方式（lru：每个进程各自缓存；shm：共享内存）。tokenmill 运行"
                               "的模型都是纯文本模型，此项不起作用；vLLM 对纯文本模型同样如此。",
    "mm_encoder_tp_mode": "多模态编码器如何使用张量并行（weights：切分权重；data：复制权重、按数据切分批次）。"
                          "tokenmill 运行的模型都是纯文本模型，此项不起作用；vLLM 对纯文本模型同样如此。",
    "enable_prompt_embeds": "允许请求直接传入提示词的嵌入向量（暂不支持）。",
    # CacheConfig
    "block_size": "每个 KV 缓存块容纳多少个 token。",
    "gpu_memory_utilization": "本实例最多可使用的显存比例（0 到 1 之间），权重、激活和 KV 缓存都计算在内，剩余部分"
                              "全部分给 KV 缓存。只约束当前实例：同一张卡上跑两个实例时可以各设 0.45。遇到显存不足时"
                              "先调低它。",
    "swap_space": "每张 GPU 的 CPU 交换空间，单位 GiB，用于 vLLM 0.7 的换出式抢占。tokenmill 与 vLLM 的 V1 引擎一样"
                  "通过重新计算来抢占，不分配交换空间；同样地，超过本机内存 70%（按张量并行的进程数累计）的取值会被拒绝。",
    "kv_cache_dtype": "KV 缓存的数据类型；auto 表示与模型相同。在 CPU 上以 float32 激活运行（默认的 GGUF 模型）时选 bfloat16，"
                      "解码每步读取的 K/V 字节减半。"
                      "fp8（即 fp8_e4m3）和 fp8_e5m2 每个 K/V 元素只占一个字节，"
                      "KV 容量翻倍；每层的 k/v 缩放因子取自检查点（没有则为 1.0）。GPU 上的 fp8_e4m3 需要计算能力 8.9 "
                      "及以上。其余 vLLM 取值暂不支持。",
    "num_gpu_blocks_override": "直接指定 KV 缓存块的数量，不再根据显存估算（用于测试和排查问题）。",
    "enable_prefix_caching": "复用相同前缀（如系统提示词、多轮对话历史）已经算好的 KV 缓存，默认开启。用 "
                             "--no-enable-prefix-caching 关闭。",
    "prefix_caching_hash_algo": "前缀缓存块键使用的哈希算法：sha256（默认，最稳妥）、sha256_cbor，或更快但非加密的 "
                                "xxhash、xxhash_cbor（需要安装 xxhash 包；多租户场景要考虑碰撞风险）。",
    "cpu_offload_gb": "把多少 GiB 的权重放到 CPU 内存中（暂不支持）。",
    "calculate_kv_scales": "根据第一次前向计算 fp8 KV 的缩放因子（vLLM 已弃用）。fp8 缓存下暂不支持；"
                           "非 fp8 缓存没有缩放因子，此选项不起作用。",
    "kv_cache_memory_bytes": "直接指定 KV 缓存的字节数，指定后不再按 --gpu-memory-utilization 计算缓存大小。支持 "
                             "4G、512M 这类写法（大写按 1024 进位）。",
    # SchedulerConfig
    "max_num_batched_tokens": "单步最多处理的 token 数（预填充分块与解码共用这份预算）。API 服务默认 2048（解码要等同一步里的"
                              "预填充分块，预算越大，出字间隔的尾部越长）；离线 LLM 类在 70 GiB 及以上、非 A100 的 GPU 上"
                              "默认 16384（与 vLLM 一致），其余情况默认 8192；关闭分块预填充时"
                              "至少等于 --max-model-len。支持 8k、16K 这类写法，auto 或 -1 表示用默认值。调大能提升"
                              "吞吐，但单步耗时和激活显存也会增加。",
    "max_num_seqs": "单步最多同时处理的请求数，默认 256。显存紧张或上下文很长时可以调小。",
    "max_num_partial_prefills": "同时处于分块预填充中的请求数上限。目前只支持 1：tokenmill 不限制同时进行的分块预填充"
                                "数量，而是用 long_prefill_token_threshold 限制每个提示词的分块大小。",
    "max_long_partial_prefills": "同时处于分块预填充中的“长提示词”（超过 long_prefill_token_threshold）请求数上限。"
                                 "与上一项相同，目前只支持 1。",
    "long_prefill_token_threshold": "提示词超过这个 token 数就算“长”，其每个分块也不超过这个数；0 表示不区分。",
    "scheduling_policy": "调度策略：fcfs 按到达顺序先来先服务；priority 按请求的 priority 值从小到大处理，相同时按"
                         "到达时间。",
    "enable_chunked_prefill": "把长提示词切成多块，与解码请求在同一步中一起执行（默认开启），可以避免长提示词卡住正在"
                              "生成的请求。",
    "async_scheduling": "设备执行第 N 步时就调度并准备第 N+1 步，减少 GPU 空闲（默认：CUDA 上开启，CPU 上关闭；流水线并行时关闭且不可开启）。",
    "stream_interval": "流式输出时每攒够多少个 token 发送一次；1 最平滑，调大可以降低主机端开销。",
    "scheduler_cls": "自定义调度器类（暂不支持）。",
    "disable_chunked_mm_input": "不把同一个多模态输入（如一张图片）拆到不同的预填充分块里。tokenmill 运行的都是纯文本"
                                "模型，提示词中没有多模态输入，此项不起作用；vLLM 对纯文本模型同样如此。",
    # LoadConfig
    "load_format": "权重格式：auto 对 .gguf 文件按 GGUF 加载，否则读取 safetensors；dummy 用随机权重（做性能测试用）。"
                   "pt、npcache、bitsandbytes 等其他格式暂不支持。",
    "download_dir": "到这个 Hugging Face 缓存目录中查找模型（tokenmill 从不联网下载）。",
    "model_loader_extra_config": "传给权重加载器的额外选项，JSON 格式。",
    "ignore_patterns": "加载时跳过的文件模式，可以写多个；默认跳过 original/**/*，避免重复加载 Llama 的原始检查点。",
    "use_tqdm_on_load": "加载权重时显示进度条。",
    "safetensors_load_strategy": "safetensors 的读取方式：lazy 内存映射按需读取（默认），eager 先整个读入内存（适合 NFS "
                                 "等网络文件系统），prefetch 预先读入页缓存。",
    "pt_load_map_location": "加载 .pt 检查点时的 map_location，例如 cpu 或 cuda。",
    # ParallelConfig
    "tensor_parallel_size": "张量并行的卡数（简写 -tp）。大于 1 时默认用 mp 后端在本机启动多个进程。",
    "pipeline_parallel_size": "流水线并行的阶段数（简写 -pp）：每个阶段持有连续的一段解码层，可与张量并行组合（共 tensor_parallel_size × pipeline_parallel_size 个进程）；开启时不能使用 async_scheduling。",
    "data_parallel_size": "数据并行的引擎副本数（简写 -dp）：每个副本是一个独立的引擎核心进程，有自己的设备和 KV 缓存，"
                          "由同一个 API 服务按队列长度和前缀缓存亲和性分发请求。",
    "data_parallel_size_local": "本节点上运行的数据并行副本数（简写 -dpl）；不填则运行从 data_parallel_start_rank 起的"
                                "全部副本。主节点填 0 表示只运行 API 服务。",
    "data_parallel_start_rank": "本节点上第一个数据并行序号（简写 -dpr），用于 --headless 的从节点；不填为 0。",
    "data_parallel_address": "数据并行主节点的地址（简写 -dpa），其他节点的引擎核心连到这里；不填为 127.0.0.1。",
    "data_parallel_rpc_port": "主节点上引擎启动握手用的 TCP 端口（简写 -dpp）；不填为 29550。",
    "distributed_executor_backend": "分布式执行后端：uni（单进程）、mp（本机多进程，多卡时的默认值）、"
                                    "ray（其余各 rank 作为 Ray 集群的 actor 运行，可跨多台机器；需先 "
                                    "pip install 'tokenmill[ray]'）、external_launcher（由 torchrun 启动，每个进程各跑"
                                    "一个引擎）。",
    "disable_custom_all_reduce": "张量并行的 all-reduce 全部走 NCCL。默认在 CUDA 上，小的 all-reduce（decode 批次）"
                                 "走基于 torch 对称内存的一次性（one-shot）all-reduce（点对点，不用 NVLink multicast）。",
    "nnodes": "mp 后端多机推理的节点数（简写 -n）。目前只支持 1；多机请用 torchrun 加 external_launcher，"
              "或在 Ray 集群上用 ray 后端（由 Ray 决定各 rank 放在哪台机器，不要再给 --nnodes）。",
    "node_rank": "mp 后端多机推理时本节点的序号（简写 -r）。",
    "master_addr": "mp 和 ray 后端各进程会合（rendezvous）的地址。与 --master-port 都取默认值时自动选一个空闲端口"
                   "（单机用本地回环地址，跨 Ray 节点时用驱动进程所在节点的 IP）。",
    "master_port": "mp 和 ray 后端各进程会合（rendezvous）的端口。",
    "distributed_timeout_seconds": "建立进程组和集合通信的超时秒数（不设则用 PyTorch 的默认值）。",
    "enable_expert_parallel": "对 MoE 层使用专家并行（简写 -ep，暂不支持）。",
    # DeviceConfig
    "device": "运行设备：auto 有 CUDA 时用 GPU，否则用 CPU；也可以指定 cuda 或 cpu。",
    # FrontendConfig
    "host": "监听地址；不填则监听所有网卡。只允许本机访问时写 127.0.0.1。",
    "port": "监听的 TCP 端口。",
    "uds": "改为监听这个 Unix 域套接字路径（此时忽略 host 和 port）。",
    "root_path": "部署在按路径转发的反向代理之后时，FastAPI 的 root_path（URL 前缀）。",
    "uvicorn_log_level": "uvicorn HTTP 服务的日志级别。生产环境常用 warning 减少日志量。",
    "disable_uvicorn_access_log": "不再为每个 HTTP 请求记录一行访问日志。",
    "h11_max_incomplete_event_size": "h11 解析器最多缓存多大的不完整 HTTP 事件（请求头或一段请求体），单位字节，"
                                     "用来防御超大请求头之类的滥用。",
    "h11_max_header_count": "单个请求最多允许多少个 HTTP 头。",
    "middleware": "额外的 ASGI 中间件，写导入路径；要加多个就重复写这个选项。函数会以 @app.middleware('http') 的"
                  "方式注册，类会通过 app.add_middleware() 注册。",
    "disable_fastapi_docs": "不提供 /docs、/redoc 和 /openapi.json 这几个接口文档页面。",
    "enable_request_id_headers": "在每个响应中加上 X-Request-Id 头。",
    "disable_frontend_multiprocessing": "让引擎与 API 服务运行在同一个进程里，而不是单独的进程。",
    "api_server_count": "API 服务进程的数量（简写 -asc）；多个进程共用同一个端口（SO_REUSEPORT），每个都连到全部引擎核心。",
    "headless": "只运行本节点的数据并行引擎核心（序号从 --data-parallel-start-rank 开始），连到 "
                "--data-parallel-address:--data-parallel-rpc-port 上的主节点，不启动 API 服务。",
    "shutdown_timeout": "关闭服务时等待进行中请求完成的秒数；0 表示立即中止。",
    "allow_credentials": "CORS：允许携带凭据（Cookie、认证头等）。",
    "allowed_origins": "CORS：允许的来源，可以写多个，也可以写 JSON 列表，例如 "
                       "'[\"https://your-frontend.example.com\"]'。",
    "allowed_methods": "CORS：允许的 HTTP 方法。",
    "allowed_headers": "CORS：允许的请求头。",
    "api_key": "设置后，/v1 下的请求必须在 Authorization: Bearer <密钥> 头中带上其中一个密钥；可以给多个密钥。",
    "ssl_keyfile": "HTTPS 私钥文件路径。",
    "ssl_certfile": "HTTPS 证书文件路径。",
    "ssl_ca_certs": "用于校验客户端证书的 CA 证书文件。",
    "ssl_cert_reqs": "是否要求客户端证书：0 不要求，1 可选，2 必须（对应 Python ssl 模块的 CERT_* 常量）。",
    "enable_ssl_refresh": "证书或私钥文件变化时自动重新加载。",
    "lora_modules": "要提供服务的 LoRA 适配器（需 --enable-lora），每个写成 name=path 或 JSON 对象 "
                    "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'；它们出现在 /v1/models 中，"
                    "请求用 \"model\": \"<名称>\" 选择。",
    "chat_template": "聊天模板：Jinja 模板文件的路径，或直接写模板内容；默认使用分词器自带的模板。",
    "chat_template_content_format": "消息内容以什么形式交给模板：string 为纯文本，openai 为带类型的分段列表（如 "
                                    "[{\"type\": \"text\", \"text\": \"...\"}]）；auto 根据模板自动判断。",
    "trust_request_chat_template": "允许请求自带 chat_template（会执行客户端提供的 Jinja 代码，仅在可信环境中开启）。",
    "default_chat_template_kwargs": "每次渲染聊天模板都会带上的额外变量，JSON 格式，例如关闭 Qwen3 的思考模式："
                                    "'{\"enable_thinking\": false}'；请求里的 chat_template_kwargs 会覆盖它。",
    "response_role": "请求设置 add_generation_prompt 时，生成消息所用的角色名。",
    "return_tokens_as_token_ids": "logprobs 中的 token 以 'token_id:<ID>' 字符串表示，这样无法编码成 UTF-8 的 token "
                                  "也能被识别。",
    "enable_auto_tool_choice": "允许模型自行决定是否调用工具（tool_choice 为 auto）；需要同时指定 --tool-call-parser。",
    "exclude_tools_when_tool_choice_none": "tool_choice 为 none 时，不把工具定义放进提示词。",
    "tool_call_parser": "把模型输出的工具调用文本解析成 OpenAI 格式 tool_calls 的解析器，按模型选择，例如 hermes、"
                        "qwen3_coder、llama3_json。",
    "tool_parser_plugin": "注册额外工具调用解析器的 Python 文件；其中注册的名字可以用于 --tool-call-parser。",
    "reasoning_parser": "把推理（思考）内容拆分到 reasoning_content 字段的解析器，按模型选择，例如 deepseek_r1、qwen3。",
    "reasoning_parser_plugin": "注册额外推理解析器的 Python 文件。",
    "structured_outputs_config": "结构化输出（JSON Schema、正则、语法约束）的设置，JSON 格式，例如 "
                                 "'{\"backend\": \"auto\"}'。",
    "enable_prompt_tokens_details": "在 usage 中返回 prompt_tokens_details（其中包括命中缓存的 token 数）。",
    "enable_force_include_usage": "无论请求怎么设置，流式响应都附带 usage 信息。",
    "enable_server_load_tracking": "统计正在处理的请求数，通过 /load 接口查询。",
    "enable_tokenizer_info_endpoint": "提供 /tokenizer_info 接口，返回分词器设置和聊天模板。",
    "disable_log_stats": "不再周期性输出引擎统计日志（吞吐、KV 缓存占用等）。",
    "enable_log_requests": "记录每个请求的 ID 和参数（DEBUG 级别下连同提示词一起记录）。",
    "enable_log_outputs": "记录每个请求生成的内容（需同时开启 --enable-log-requests）。",
    "max_log_len": "日志中的提示词和输出最多记录多少个字符或 token ID；不填表示不截断。",
    "log_config_file": "JSON 格式的日志配置文件（logging.config.dictConfig 的格式），用于配置服务的日志输出。",
    # NotYetSupported: general and front end
    "grpc": "改为提供 gRPC 服务，而不是 HTTP 的 OpenAI 接口。",
    "aggregate_engine_logging": "数据并行时输出所有引擎汇总后的统计，而不是逐个引擎输出。",
    "fail_on_environ_validation": "环境变量校验失败时直接报错退出。",
    "gdn_prefill_backend": "Gated DeltaNet 预填充使用的后端（flashinfer 或 triton）。",
    "tool_server": "内置工具所用的工具服务器（host:port 列表，或 demo）。",
    "enable_log_deltas": "配合 --enable-log-outputs，记录流式输出的每个增量。",
    "log_error_stack": "请求出错时在日志中记录完整的调用栈。",
    "tokens_only": "只提供 token 进、token 出的接口，不提供文本接口。",
    "disable_access_log_for_endpoints": "不记录访问日志的路径，逗号分隔，例如 /health,/metrics。",
    "ssl_ciphers": "HTTPS 使用的加密套件（仅对 TLS 1.2 及以下有效）。",
    "enable_offline_docs": "使用内置的静态资源提供接口文档页面，适合无法访问外网的环境。",
    "enable_flash_late_interaction": "在 GPU 上为延迟交互（late interaction）模型计算 MaxSim 打分。",
    # NotYetSupported: model
    "runner": "模型运行器类型（auto、generate、pooling、draft）；tokenmill 只做文本生成，可写 auto 或 generate。",
    "convert": "把模型改造成其他任务（embed、classify）使用；只接受 auto 或 none。",
    "task": "vLLM 0.7 的任务选择（generate、embed 等）；只接受 auto 或 generate。",
    "allowed_local_media_path": "允许请求读取本地图片、视频的服务器目录。",
    "allowed_media_domains": "多模态输入的 URL 只允许来自这些域名。",
    "allow_deprecated_quantization": "允许使用已弃用的量化方法。",
    "enable_return_routed_experts": "返回每个 token 被路由到的 MoE 专家。",
    "config_format": "模型配置的格式（auto、hf、mistral）；只接受 auto 或 hf。",
    "hf_token": "访问 Hugging Face 远程文件的令牌（tokenmill 不联网下载）。",
    "pooler_config": "嵌入类（池化）模型的池化设置。",
    "enable_sleep_mode": "允许引擎进入休眠并释放显存。",
    "model_impl": "模型实现（auto、vllm、transformers、terratorch）；只接受 auto 或 vllm（即引擎自带的实现）。",
    "override_attention_dtype": "单独指定注意力计算的数据类型。",
    "logits_processors": "自定义 logits 处理器类。",
    "logits_processor_pattern": "请求中允许引用的 logits 处理器名称的正则表达式。",
    "io_processor_plugin": "启动时加载的 IOProcessor 插件。",
    "renderer_num_workers": "负责分词和聊天模板渲染的线程数。",
    "rope_scaling": "RoPE 缩放设置；请改用 --hf-overrides.rope_scaling。",
    "rope_theta": "RoPE 的 theta；请改用 --hf-overrides.rope_theta。",
    "mm_processor_kwargs": "传给多模态预处理器的参数。",
    "max_seq_len_to_capture": "CUDA Graph 覆盖的最长序列（vLLM 0.7 的选项）。",
    "attention_backend": "注意力后端；只接受 auto。",
    "mamba_backend": "Mamba SSM 使用的后端。",
    "enable_mamba_cache_stochastic_rounding": "写入 Mamba 状态缓存时使用随机舍入。",
    "mamba_cache_philox_rounds": "Mamba 随机舍入所用 Philox 随机数生成器的轮数。",
    "guided_decoding_backend": "vLLM 0.7 的结构化输出后端；请改用 --structured-outputs-config。",
    # NotYetSupported: parallelism and distribution
    "numa_bind": "把各个 GPU 工作进程绑定到对应的 NUMA 节点。",
    "numa_bind_nodes": "每张 GPU 绑定的 NUMA 节点编号。",
    "numa_bind_cpus": "每张 GPU 绑定的 CPU 列表。",
    "decode_context_parallel_size": "解码阶段上下文并行的组大小（简写 -dcp）。",
    "dcp_comm_backend": "解码上下文并行的通信后端。",
    "dcp_kv_cache_interleave_size": "解码上下文并行时 KV 缓存的交错粒度。",
    "cp_kv_cache_interleave_size": "上下文并行时 KV 缓存的交错粒度。",
    "prefill_context_parallel_size": "预填充阶段上下文并行的组大小（简写 -pcp）。",
    "data_parallel_rank": "本实例的数据并行序号（简写 -dpn）。",
    "data_parallel_backend": "数据并行后端，mp 或 ray（简写 -dpb）。",
    "data_parallel_hybrid_lb": "数据并行的混合负载均衡模式（简写 -dph）。",
    "data_parallel_external_lb": "数据并行的外部负载均衡模式（简写 -dpe）。",
    "enable_ep_weight_filter": "专家并行时每个进程只加载自己负责的专家权重。",
    "all2all_backend": "专家并行所用的 all-to-all 通信后端。",
    "enable_dbo": "开启双批次重叠（dual batch overlap）。",
    "ubatch_size": "微批次大小。",
    "enable_elastic_ep": "弹性专家并行。",
    "dbo_decode_token_threshold": "纯解码批次启用双批次重叠的 token 阈值。",
    "dbo_prefill_token_threshold": "含预填充的批次启用双批次重叠的 token 阈值。",
    "disable_nccl_for_dp_synchronization": "数据并行同步改用 Gloo 而不是 NCCL。",
    "enable_eplb": "为 MoE 层开启专家并行负载均衡。",
    "eplb_config": "专家并行负载均衡的设置。",
    "expert_placement_strategy": "专家在各进程上的摆放策略（linear 或 round_robin）。",
    "max_parallel_loading_workers": "分批加载模型时并行加载的工作进程数。",
    "ray_workers_use_nsight": "用 nsight 分析 Ray 工作进程。",
    "worker_cls": "工作进程使用的类。",
    "worker_extension_cls": "工作进程的扩展类。",
    # NotYetSupported: cache and offloading
    "kv_cache_dtype_skip_layers": "不对 KV 缓存做量化的层。",
    "kv_sharing_fast_prefill": "在共享 KV 的层中跳过预填充 token。",
    "mamba_cache_dtype": "Mamba 缓存的数据类型。",
    "mamba_ssm_cache_dtype": "Mamba SSM 状态的数据类型。",
    "mamba_block_size": "Mamba 缓存的块大小。",
    "mamba_cache_mode": "Mamba 层的前缀缓存策略。",
    "kv_offloading_size": "卸载到 CPU 内存的 KV 缓存大小，单位 GiB。",
    "kv_offloading_backend": "KV 缓存卸载的后端（native 或 lmcache）。",
    "offload_backend": "权重卸载的后端。",
    "cpu_offload_params": "要卸载到 CPU 的参数名片段。",
    "offload_group_size": "每多少层分为一组，卸载每组的最后几层。",
    "offload_num_in_group": "每组卸载的层数。",
    "offload_prefetch_step": "提前预取多少层。",
    "offload_params": "要预取卸载的参数名片段。",
    # NotYetSupported: multimodal and LoRA
    "language_model_only": "禁用全部多模态输入，只当作语言模型使用。",
    "limit_mm_per_prompt": "每个提示词中每种模态最多允许多少项输入，例如 '{\"image\": 10, \"video\": 2}'。",
    "enable_mm_embeds": "允许请求直接传入多模态嵌入向量。",
    "enable_lora": "启用 LoRA 适配器。",
    "max_loras": "一个批次中最多同时使用的 LoRA 数（设备上的槽位数）。",
    "max_lora_rank": "适配器允许的最大 LoRA 秩。",
    "lora_dtype": "适配器权重的数据类型；auto 表示与模型相同。",
    "enable_tower_connector_lora": "对多模态模型的视觉塔和连接层也应用 LoRA。",
    "max_cpu_loras": "主机内存中最多缓存多少个已加载的 LoRA（最久未用的先淘汰）；必须 >= max_loras，默认等于 max_loras。",
    "fully_sharded_loras": "把适配器计算完全分片到各张量并行进程上（目前只支持单进程，此时没有区别）。",
    "lora_target_modules": "只在这些投影上应用适配器（模块后缀，如 o_proj qkv_proj）；默认：适配器包含的全部投影。",
    "default_mm_loras": "按模态自动启用的 LoRA。",
    "specialize_active_lora": "按活跃 LoRA 的数量分别捕获 CUDA Graph。",
    "enable_prompt_adapter": "启用提示词适配器（vLLM 0.7 的选项）。",
    # NotYetSupported: observability
    "show_hidden_metrics_for_version": "重新显示自某个版本起被隐藏的已弃用指标。",
    "otlp_traces_endpoint": "OpenTelemetry 链路追踪数据的发送地址。",
    "collect_detailed_traces": "对哪些模块收集详细的追踪数据。",
    "kv_cache_metrics": "统计 KV 缓存块的驻留情况（存活时间、空闲时间、复用间隔）。",
    "kv_cache_metrics_sample": "KV 缓存指标的采样比例。",
    "cudagraph_metrics": "统计 CUDA Graph 相关指标。",
    "enable_layerwise_nvtx_tracing": "为每一层添加 NVTX 标记。",
    "enable_mfu_metrics": "统计模型 FLOPs 利用率（MFU）。",
    "enable_logging_iteration_details": "记录每次迭代的详细信息。",
    # NotYetSupported: scheduler
    "scheduler_reserve_full_isl": "只有整个提示词都放得进 KV 缓存时才接纳新请求。",
    "disable_hybrid_kv_cache_manager": "所有类型的注意力层使用同样的 KV 缓存布局。",
    "num_scheduler_steps": "多步调度（vLLM 0.7 的选项）。",
    "scheduler_delay_factor": "调度下一个提示词之前的延迟系数（vLLM 0.7 的选项）。",
    "preemption_mode": "抢占方式：recompute 或 swap（vLLM 0.7 的选项）；tokenmill 固定为 recompute。",
    "num_lookahead_slots": "推测解码用的前瞻槽位（vLLM 0.7 的选项）。",
    # NotYetSupported: compilation, kernels and whole-engine configs
    "cudagraph_capture_sizes": "为哪些解码批大小捕获 CUDA Graph（默认 1、2、4、8，之后按 8 或 16 递增到上限）。",
    "max_cudagraph_capture_size": "捕获 CUDA Graph 的最大解码批大小（默认 min(max_num_seqs, 512)），也限制混合批图的词元容量。",
    "cudagraph_mode": ("哪些批次重放 CUDA Graph。FULL_DECODE_ONLY：只有解码批；FULL、PIECEWISE、FULL_AND_PIECEWISE"
                       "（默认，与 vLLM 相同）：解码批，以及含预填充分块、不超过 512 个词元的批（tokenmill 对这些批同样"
                       "捕获包括注意力在内的整个前向）；NONE：不用图（同 enforce_eager）。"),
    "ir_op_priority": "vLLM IR 算子的优先级。",
    "enable_flashinfer_autotune": "为 FlashInfer 内核做自动调优。",
    "moe_backend": "MoE 专家计算使用的内核后端。",
    "speculative_config": ("推测解码的设置，一个 JSON 对象（简写 -sc），例如 '{\"method\": \"ngram\", "
                           "\"num_speculative_tokens\": 4}' 或 '{\"method\": \"suffix\", \"num_speculative_tokens\": 8}'。"
                           "键：method（ngram、suffix、draft_model、eagle、eagle3）、model（草稿模型或 EAGLE 头）、num_speculative_tokens（1..16）、"
                           "prompt_lookup_min/max、disable_by_batch_size、suffix_decoding_*、"
                           "draft_tensor_parallel_size、quantization / max_model_len / revision（草稿模型的）、"
                           "benchmark_acceptance_rate（仅用于随机权重测速）、step_aside（默认 true：实测不用草稿更快时"
                           "就不推测）。MTP 暂不支持。"),
    "speculative_model": "推测解码的草稿模型（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "num_speculative_tokens": "每步推测的 token 数（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "ngram_prompt_lookup_max": "ngram 提示查找的最大窗口（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "ngram_prompt_lookup_min": "ngram 提示查找的最小窗口（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "speculative_disable_by_batch_size": "请求数超过此值时不做推测（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "speculative_draft_tensor_parallel_size": "草稿模型的张量并行数（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "speculative_max_model_len": "草稿模型支持的最大序列长度（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "speculative_model_quantization": "草稿模型的量化方法（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "speculative_disable_mqa_scorer": "不用 MQA scorer 而用批扩展（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "spec_decoding_acceptance_method": "草稿 token 的接受方法（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "typical_acceptance_sampler_posterior_threshold": "典型接受采样的阈值（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "typical_acceptance_sampler_posterior_alpha": "典型接受采样的 alpha（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "disable_logprobs_during_spec_decoding": "推测解码时不算 logprobs（vLLM 0.7 的选项，请改用 --speculative-config）。",
    "kv_transfer_config": "分布式 KV 缓存传输（预填充与解码分离部署）的设置。",
    "kv_events_config": "KV 缓存事件发布的设置。",
    "ec_transfer_config": "分布式编码器缓存传输的设置。",
    "compilation_config": ("vLLM 的编译配置，JSON 格式（-cc，或 -cc.键 值）：其中 cudagraph_capture_sizes、"
                           "max_cudagraph_capture_size、cudagraph_mode 与同名参数等效；mode / level（torch.compile "
                           "级别 0-3）：在 CPU 上，非 0 的级别让模型的每一步经 torch.compile 运行（与 -O3 相同，启动更慢、每步"
                           "更快），0 / NONE 则不编译；在 GPU 上不改变任何行为（tokenmill 在 GPU 上运行自己的融合 Triton "
                           "内核和 CUDA Graph）。其他键会报错。"),
    "attention_config": "注意力的设置（简写 -ac）。",
    "reasoning_config": "推理模型的设置。",
    "kernel_config": "内核相关的设置。",
    "additional_config": "特定平台的额外设置。",
    "profiler_config": "性能分析器的设置。",
    "optimization_level": ("-O0：不用 CUDA Graph（启动最快）；-O1：只为解码批捕获图；-O2（默认）和 -O3：解码批与混合批"
                           "都用图。显式指定的 --cudagraph-mode 优先。在 CPU 上，-O3 还会用 torch.compile 编译模型的每一步"
                           "（默认模型每步快 14-19%，启动时多花约 15 秒，首次约 80 秒）。"),
    "performance_mode": "性能模式：balanced、interactivity 或 throughput。",
    "weight_transfer_config": "强化学习训练中权重传输的设置。",
}
