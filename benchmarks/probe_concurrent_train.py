"""Probe: two SmolLM2 drafter trainings on one GPU at once vs one alone (step time of each)."""
import json, pathlib, statistics, subprocess, sys, time
sys.path.insert(0, str(pathlib.Path(__file__).parent))
import bench_reference as br

import glob
import shutil

def main():
    from dflash.target.assets import convert_gguf_to_hf
    work = pathlib.Path("/tmp/probe")
    work.mkdir(exist_ok=True)
    model = str(convert_gguf_to_hf(sys.argv[2], work / "smollm2-hf"))
    data = br.spread_records(br.first_records(sorted(glob.glob("benchmarks/assets/quality/sharegpt_whole-0*.jsonl.gz")),
                                              None, work / "all.jsonl"), 2000, work / "spread.jsonl")
    cache = work / "c2k"
    br.extract_cache(model, [data], cache, storage="int4", device="cuda", dtype="bfloat16", max_length=2048,
                     batch_tokens=65536)

    def cmd(name, storage, steps):
        return [sys.executable, "-c", "from cli.main import main; main()", "train", "--cache", str(cache), "--model", model,
                "--output", str(work / name), "--layers", "5", "--block-size", "16", "--num-anchors", "512",
                "--batch-tokens", "16384", "--mask-token-id", "16", "--log-every", "10", "--steps", str(steps), "--save-every", "100000",
                "--online", "--online-storage", storage]

    def med(name):
        recs = [json.loads(l) for l in open(work / name / "metrics.jsonl")]
        st = [r["step_time_s"] for r in recs[2:] if r.get("step_time_s")]
        return statistics.median(st) if st else None

    for n in ("solo", "pa", "pb"):
        shutil.rmtree(work / n, ignore_errors=True)
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    t = time.time(); subprocess.run(cmd("solo", "fp8", steps), check=True, capture_output=True); solo_wall = time.time() - t
    t = time.time()
    ps = [subprocess.Popen(cmd(n, s, steps), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for n, s in (("pa", "fp8"), ("pb", "bf16"))]
    errs = [p.communicate()[1] for p in ps]
    pair_wall = time.time() - t
    for p, e in zip(ps, errs):
        if p.returncode:
            print(e.decode()[-3000:])
    print(json.dumps({"steps": steps, "solo_step_s": med("solo"), "solo_wall_s": solo_wall, "pair_step_s": [med("pa"), med("pb")],
                      "pair_wall_s": pair_wall}))


if __name__ == "__main__":
    main()
