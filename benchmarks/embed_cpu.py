#!/usr/bin/env python3
"""Embed the first N texts of the shared text corpus on the CPU, for CPU-only benchmarks.

Same model and recipe as /work/shared/tools/text_embeddings.py ``embed`` (all-MiniLM-L6-v2,
max_length 128, mean pooling over the attention mask, L2-normalised, stored float16, 384-d);
the difference is that it runs the model in float32 on the CPU, because CPU float16 matmuls
are slow. The last ``--queries`` of the N texts become the queries, the rest the base.
Output: {"base": f16 [N-Q,384], "queries": f16 [Q,384], "gt": int32 [Q,100]} (exact L2 top-100,
which equals the cosine top-100 on normalised vectors), the format benchmarks/datasets.py loads.

    nohup python3 -m benchmarks.embed_cpu --texts 101000 --queries 1000 \
        --out .data/text100k.pt > .data/embed100k.log 2>&1 &
"""
import argparse, lzma, os, time

import torch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=".data/text", help="folder holding corpus.txt.xz and minilm/")
    ap.add_argument("--texts", type=int, default=101_000, help="first N texts of the corpus")
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--out", default=".data/text100k.pt")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from transformers import AutoModel, AutoTokenizer

    texts = lzma.open(os.path.join(a.dir, "corpus.txt.xz"), "rt").read().split("\n")[: a.texts]
    tok = AutoTokenizer.from_pretrained(os.path.join(a.dir, "minilm"))
    model = AutoModel.from_pretrained(os.path.join(a.dir, "minilm"), dtype=torch.float32).eval()
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # similar lengths batch together
    emb = torch.empty(len(texts), 384, dtype=torch.float16)
    t0 = time.time()
    with torch.inference_mode():
        for s in range(0, len(order), a.batch):
            idx = order[s : s + a.batch]
            enc = tok([texts[i] for i in idx], padding=True, truncation=True, max_length=128, return_tensors="pt")
            h = model(**enc).last_hidden_state
            w = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
            v = torch.nn.functional.normalize((h * w).sum(1) / w.sum(1).clamp(min=1), dim=1)
            emb[torch.tensor(idx)] = v.half()
            if (s // a.batch) % 20 == 0:
                print(f"{s + len(idx)}/{len(texts)} texts, {time.time() - t0:.0f} s", flush=True)
    nq = a.queries
    base, q = emb[:-nq].clone(), emb[-nq:].clone()  # own storage: saving a view saves all of emb
    bf, qf = base.float(), q.float()
    bn = (bf * bf).sum(1)
    gt = torch.cat([(bn[None] - 2 * qf[s : s + 256] @ bf.T).topk(100, dim=1, largest=False).indices
                    for s in range(0, nq, 256)])
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    torch.save({"base": base, "queries": q, "gt": gt.int()}, a.out)
    print(f"base {tuple(base.shape)} queries {tuple(q.shape)} -> {a.out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
