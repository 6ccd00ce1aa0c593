"""Run under `torchrun --nproc-per-node N` by test_tp_engine.py and test_pp.py: every process runs its own engine
(external_launcher); rank 0 writes the greedy tokens as JSON to argv[2]. Optional argv[5], argv[6]: the tensor-
and pipeline-parallel sizes (default 2 and 1)."""
import json
import os
import sys

from tokenmill import LLM, SamplingParams

if __name__ == "__main__":
    model, out_path, prompts, max_tokens = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    tp, pp = (int(sys.argv[5]), int(sys.argv[6])) if len(sys.argv) > 6 else (2, 1)
    llm = LLM(model, max_model_len=256, num_gpu_blocks_override=64, max_num_seqs=8, tensor_parallel_size=tp,
              pipeline_parallel_size=pp, distributed_executor_backend="external_launcher")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
    if int(os.environ["RANK"]) == 0:
        with open(out_path, "w") as f:
            json.dump([o.outputs[0].token_ids for o in outs], f)
