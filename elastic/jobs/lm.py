"""A second job, a small language model, to prove the contract is not shaped by images.

A small transformer language model (:mod:`.tiny_lm`) learns the next tokens of generated
sequences (:mod:`.tokens`). Its loss is each sequence's mean cross-entropy, and its next-token
accuracy is a metric of each step. Its evaluation is the next token's top-1/top-5 on held-out
sequences. ``job=lm``; its settings are ``job.*`` (conf/job/lm.yaml).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic.config import Config, bounded, problem
from elastic.job import Batch, EvalContext, Job, Loss

if TYPE_CHECKING:
    import torch

    from elastic.evaluate import EvalResult
    from elastic.jobs.tokens import TokenSequences


@dataclass
class LanguageModelSettings:
    vocab: int = bounded(64, ge=4, fix="set job.vocab to 4 or more")
    # Tokens a sequence trains on (each with the one after it as its target).
    context: int = bounded(32, ge=2, fix="set job.context to 2 or more")
    sequences: int = bounded(2048, ge=1, fix="set job.sequences (an epoch's) to 1 or more")
    # Held out for evaluation (every trainer.eval_every_epochs); 0: none.
    val_sequences: int = bounded(256, ge=0, fix="set job.val_sequences to 0 (none) or more")
    dim: int = bounded(64, ge=8, fix="set job.dim to 8 or more")
    heads: int = bounded(4, ge=1, fix="set job.heads to 1 or more")
    layers: int = bounded(2, ge=1, fix="set job.layers to 1 or more")
    grammar_seed: int = 0  # which generated language


class LanguageModelJob(Job[LanguageModelSettings]):
    Settings = LanguageModelSettings

    @classmethod
    def problems(cls, cfg: Config, settings: LanguageModelSettings) -> list[str]:
        if settings.dim % settings.heads:
            return [
                problem(
                    "job.dim",
                    settings.dim,
                    f"must split evenly into job.heads={settings.heads} attention heads",
                    "set job.dim to a multiple of job.heads",
                )
            ]
        return []

    def _sequences(self, count: int, first: int) -> TokenSequences:
        from elastic.jobs.tokens import TokenSequences

        s = self.settings
        # context + 1 tokens: each position's target is the token after it.
        return TokenSequences(s.vocab, s.context + 1, count, s.grammar_seed, first)

    def train_data(self) -> TokenSequences:
        return self._sequences(self.settings.sequences, 0)

    def build_model(self) -> torch.nn.Module:
        from elastic.jobs.tiny_lm import TinyLM

        s = self.settings
        return TinyLM(s.vocab, s.context, s.dim, s.heads, s.layers).to(self.device)

    def shard_units(self) -> tuple[type[torch.nn.Module], ...]:
        """Each transformer block is a unit of its own (``parallel.shard=node``)."""
        from torch import nn

        return (nn.TransformerEncoderLayer,)

    def loss(self, model: torch.nn.Module, batch: Batch) -> Loss:
        """Each sequence's mean next-token cross-entropy, and its next-token accuracy."""
        import torch.nn.functional as F

        logits, targets = next_tokens(model, batch)
        per_token = F.cross_entropy(logits, targets, reduction="none")
        hits = logits.detach().argmax(1).eq(targets).float()
        sequences = len(batch[0])
        return Loss(
            per_token.view(sequences, -1).mean(1),
            {"accuracy": hits.view(sequences, -1).mean(1)},
        )

    def has_validation(self) -> bool:
        return self.settings.val_sequences > 0

    def evaluate(self, model: torch.nn.Module, ctx: EvalContext) -> EvalResult:
        s = self.settings
        return ctx.evaluate(
            model, self._sequences(s.val_sequences, s.sequences), predict=next_tokens
        )


def next_tokens(model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Every position's logits and the token that follows it, flattened.

    Their shapes are ``(tokens, vocab)`` and ``(tokens,)``."""
    (tokens,) = batch
    logits: Any = model(tokens[:, :-1])
    return logits.flatten(0, 1), tokens[:, 1:].flatten()
