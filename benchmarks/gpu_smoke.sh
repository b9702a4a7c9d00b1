# GPU smoke run of the real CLIs on a tiny random target with SmolLM2's tokenizer: regen, capture,
# sf-train with flex + triton + compiled elementwise + pinned loader, grad-accum 2.
#   TOK=folder/with/SmolLM2/tokenizer+config bash benchmarks/gpu_smoke.sh
# TOK holds config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja and
# generation_config.json of the converted SmolLM2 (~/.cache/specfoundry/SmolLM2-135M-Instruct);
# carry it to the device. Result: benchmarks/results/gpu_smoke/e2e.log.
set -euo pipefail
TOK=${TOK:-.dev/tok}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
W=/tmp/e2e; rm -rf $W; mkdir -p $W
sf() { local m=$1; shift; python3 -c "import sys; from specfoundry.$m.cli import main; sys.argv[0] = 'sf-$m'; main()" "$@"; }
python3 - <<PY
import json, random, shutil
from pathlib import Path
import torch
from transformers import LlamaConfig, LlamaForCausalLM
t = Path("$W/target"); t.mkdir()
c = json.load(open("$TOK/config.json"))
c.update(hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(**{k: v for k, v in c.items() if k not in ("architectures", "transformers_version")})).save_pretrained(t)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    shutil.copy(f"$TOK/{f}", t / f)
r = random.Random(0)
words = "the a cat dog runs fast slow python code list sort number add sum question answer why how what".split()
with open("$W/convs.jsonl", "w") as f:
    for _ in range(400):
        f.write(json.dumps({"messages": [{"role": "user", "content": " ".join(r.choice(words) for _ in range(r.randint(5, 20)))},
                                         {"role": "assistant", "content": "x"}]}) + "\n")
PY
sf generate $W/convs.jsonl -o $W/regen --target $W/target --greedy --max-new-tokens 64 --batch-size 128 --shard-size 200 --on-truncated flag --silent 2>&1 | tail -3
sf capture run $W/regen -o $W/fs --target $W/target --codec safetensors --max-length 128 --silent 2>&1 | tail -3
sf train --featureset $W/fs --output $W/train --target $W/target --attention flex --loss triton --grad-accum 2 \
  --max-steps 80 --max-tokens 2048 --max-length 128 --eval-every 40 --save-every 40 --log-every 10 --lr 3e-3 \
  --warmup-steps 5 --draft-vocab-size 2048 2>&1 | grep -v "it/s\]\|s/it\]" | tail -25
python3 -c "
import json; h = json.load(open('$W/train/history.json'))
print('first', {k: round(v, 3) for k, v in h[0].items() if k in ('loss_0', 'acc_0')}, 'last', {k: round(v, 3) for k, v in h[-1].items() if k in ('loss_0', 'acc_0', 'eval_acc_0', 'eval_sim_accept_len')})"
