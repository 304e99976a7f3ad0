"""auto (model drafter) request by request with target-only interleaved, bench-like: the carried acceptance
estimate, costs and probe state each auto request starts from, and what it then did. Usage:
python bench/auto_state_diag.py (the int4 pair of scripts/demo.sh); output: bench/results/auto_state_diag.log"""
import specrt
from pathlib import Path
from specrt.runtime.bench import read_prompts
pair = specrt.load('pairs/qwen2.5-coder-0.5b-1.5b-int4')
pl = read_prompts(Path('bench/prompts/prompts.jsonl'), pair)
cf = lambda k: pair.config(max_new_tokens=128, draft_len=k, drafter='model')
for k in (0, 'auto'):
    pair.run(pl[0].ids, cf(k))
for r in range(2):
    for i, p in enumerate(pl):
        order = [0, 'auto'] if (r * 9 + i) % 2 == 0 else ['auto', 0]
        for k in order:
            pair.draft_memory.keep(0)
            c = pair.costs
            pre = 'acc %s c1 %.1f c2 %.1f c3 %.1f d %.1f probes %s' % ([round(x, 2) for x in pair.acceptance.get('model', [])[:3]], c.target(1)*1e3, c.target(2)*1e3, c.target(3)*1e3, c.draft_s*1e3, pair.probes.get('model'))
            s = pair.run(p.ids, cf(k)).stats
            if k == 'auto':
                print(r, p.id.ljust(15), pre, '->', s['draft_len_hist'], 'tok/s %.1f' % s['tokens_per_s'], flush=True)
