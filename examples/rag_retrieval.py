"""Retrieval for retrieval-augmented generation, on one device from tokens to context.

A small torch encoder (IDF-weighted bag of token embeddings and a projection, randomly
initialised: swap in your trained encoder) embeds a corpus of passages; a grnnd.nn.Retriever
inside the model indexes them. Queries are encoded by the same model, searched, and the tokens
of the retrieved passages are gathered as the context a reader would consume. Corpus and queries
are generated on the device; no tensor is copied to the host, only the final scores are read.

The synthetic corpus has topics: a passage mixes words of its topic with background words, and
a query quotes a few words of one passage among common background words. The run checks its own outcome (the quoted
passage is retrieved, the retrieved passages share its topic, graph search agrees with exact
search) and exits non-zero if it falls short.

    python examples/rag_retrieval.py                        # 200 000 passages, CUDA if available
    python examples/rag_retrieval.py --smoke --device cpu   # a few seconds on a laptop CPU
"""
import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn

import torch_grnnd as grnnd


class Corpus:
    """Passages of `length` tokens on `device`: a share of words from the passage's topic (each
    topic owns `topic_words` tokens), the rest Zipf-distributed background words."""

    def __init__(self, passages: int, topics: int, vocab: int, length: int, device: torch.device, seed: int,
                 topic_words: int = 40, topic_share: float = 0.5):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.first_background = topics * topic_words
        self.zipf = 1.0 / torch.arange(1, vocab - self.first_background + 1, device=device, dtype=torch.float32)
        self.topic = torch.randint(topics, (passages,), device=device, generator=self.generator)
        from_topic = torch.rand(passages, length, device=device, generator=self.generator) < topic_share
        topic_token = self.topic[:, None] * topic_words + torch.randint(
            topic_words, (passages, length), device=device, generator=self.generator)
        self.tokens = torch.where(from_topic, topic_token, self.background_words((passages, length)))

    def background_words(self, shape) -> torch.Tensor:
        drawn = torch.multinomial(self.zipf, shape[0] * shape[1], replacement=True, generator=self.generator)
        return self.first_background + drawn.view(shape)

    def queries(self, count: int, quoted: int, filler: int):
        """`count` queries, each `quoted` random tokens of one passage plus `filler` background
        words; returns (query tokens, the quoted passage)."""
        device = self.tokens.device
        source = torch.randint(self.tokens.shape[0], (count,), device=device, generator=self.generator)
        positions = torch.rand(count, self.tokens.shape[1], device=device, generator=self.generator).argsort(1)
        quotes = self.tokens[source].gather(1, positions[:, :quoted])
        return torch.cat([quotes, self.background_words((count, filler))], dim=1), source


class Encoder(nn.Module):
    """Token sequences -> unit vectors: IDF-weighted sum of token embeddings, then a projection."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.embed = nn.EmbeddingBag(vocab, dim, mode="sum")
        self.project = nn.Linear(dim, dim)
        self.register_buffer("idf", torch.ones(vocab))

    def fit_idf(self, tokens: torch.Tensor) -> None:
        """Down-weight words by how many passages contain them (frequent words say little)."""
        vocab = self.idf.shape[0]
        rows = torch.arange(tokens.shape[0], device=tokens.device).unsqueeze(1)
        passage_word = torch.unique(rows * vocab + tokens)  # each (passage, word) once
        passages_with_word = torch.bincount(passage_word % vocab, minlength=vocab).float()
        self.idf = torch.log((1 + tokens.shape[0]) / (1 + passages_with_word)) + 1

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pooled = self.embed(tokens, per_sample_weights=self.idf[tokens])
        return F.normalize(self.project(pooled), dim=1)


class RetrievalModel(nn.Module):
    """An encoder and the index of the passages it encoded: both in state_dict(), both move with .to()."""

    def __init__(self, vocab: int, dim: int, k: int):
        super().__init__()
        self.encoder = Encoder(vocab, dim)
        # Inner product of unit vectors ranks as cosine similarity does.
        self.index = grnnd.nn.Retriever(k=k, metric="ip", list_size=192)

    @torch.no_grad()
    def index_passages(self, passage_tokens: torch.Tensor, batch: int = 65_536) -> None:
        self.encoder.fit_idf(passage_tokens)
        self.index.rebuild(torch.cat([self.encoder(chunk) for chunk in passage_tokens.split(batch)]))

    def forward(self, query_tokens: torch.Tensor):
        return self.index(self.encoder(query_tokens))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes for a quick check")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    passages, topics, vocab, queries = (3_000, 20, 4_000, 300) if args.smoke else (200_000, 500, 50_000, 10_000)
    dim, k, length = 384, 10, 64
    device = torch.device(args.device)
    torch.manual_seed(args.seed)

    corpus = Corpus(passages, topics, vocab, length, device, args.seed)
    query_tokens, source = corpus.queries(queries, quoted=16, filler=4)

    model = RetrievalModel(vocab, dim, k).to(device)
    model.index_passages(corpus.tokens)
    print(f"indexed {passages} passages of {length} tokens: {model.index}")

    with torch.no_grad():
        dists, ids = model(query_tokens)
        context = corpus.tokens[ids]  # [queries, k, length]: what a reader would attend over
        _, exact_ids = grnnd.knn(model.index.data, model.encoder(query_tokens), k, metric="ip")
    tensors = {"dists": dists, "ids": ids, "context": context}
    home = corpus.tokens.device  # "cuda" resolved to the index it names, e.g. cuda:0
    off_device = [name for name, t in tensors.items() if t.device != home]

    hit = (ids == source[:, None]).any(1).float().mean().item()
    same_topic = (corpus.topic[ids] == corpus.topic[source][:, None]).float().mean().item()
    recall = grnnd.recall(ids, exact_ids)
    print(f"quoted passage among the top {k}: {hit:.3f}")
    print(f"retrieved passages on the query's topic: {same_topic:.3f}")
    print(f"recall@{k} of graph search against exact search: {recall:.3f}")
    print(f"context for the reader: {tuple(context.shape)} {context.dtype} on {context.device}")

    failures = []
    if off_device:
        failures.append(f"{off_device} left {home}")
    if hit < 0.9:
        failures.append(f"quoted passage found for only {hit:.3f} of the queries (< 0.9)")
    if same_topic < 0.8:
        failures.append(f"only {same_topic:.3f} of the retrieved passages share the topic (< 0.8)")
    if recall < 0.95:
        failures.append(f"graph search recall {recall:.3f} < 0.95")
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    if not failures:
        print("OK")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
