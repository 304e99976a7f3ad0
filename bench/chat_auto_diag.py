"""Per chat prompt: target-only then auto, alternating, with auto's plan (draft_len_hist, rounds skipped,
predicted vs measured speedup). Usage: python bench/chat_auto_diag.py (the int4 pair of scripts/demo.sh)."""
import specrt
from pathlib import Path
from specrt.runtime.bench import read_prompts
pair = specrt.load('pairs/qwen2.5-coder-0.5b-1.5b-int4')
pl = [p for p in read_prompts(Path('bench/prompts/prompts.jsonl'), pair) if p.kind == 'chat']
pair.run(pl[0].ids, pair.config(max_new_tokens=32, draft_len='auto', drafter='model'))
for rep in range(2):
    for p in pl:
        pair.draft_memory.forget()
        a = pair.run(p.ids, pair.config(max_new_tokens=128, draft_len=0)).stats
        pair.draft_memory.forget()
        b = pair.run(p.ids, pair.config(max_new_tokens=128, draft_len='auto', drafter='model')).stats
        print(p.id, 'none %.1f auto %.1f' % (a['tokens_per_s'], b['tokens_per_s']), 'ratio %.3f' % (b['tokens_per_s']/a['tokens_per_s']),
              'hist', b['draft_len_hist'], 'skipped', b['rounds_skipped'], 'pred %.2f meas %.2f' % (b['predicted_speedup'], b['measured_speedup']),
              'acc', [round(x,2) for x in b['accepted_per_position']], 'ttft %.0f/%.0f' % (1e3*a['ttft_s'], 1e3*b['ttft_s']), flush=True)
print('costs', pair.costs.draft_s, {k: round(v*1e3,1) for k, v in pair.costs.target_s.items()})
print('acceptance prior', {k: [round(x,2) for x in v] for k, v in pair.acceptance.items()}, pair.probes)
