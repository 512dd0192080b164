"""Head kinds: Medusa, EAGLE-3 and its EAGLE-1/2 variant, each one object chosen once from the
recipe (`head_kind(recipe.heads)`).

A head kind owns what differs between the kinds in training: the heads config it builds for a
target, whether its heads take a draft vocab, how the target's taps become the heads' inputs
(`inputs`), the loss of the heads' output (`loss`), and the draft logits its held-out accuracy
is measured on (`draft_logits`, training/calibrate.py). Everything that calls them (the step,
the feature sources, calibration) is the same for every kind. Its `shape_keys` are the config
fields besides every kind's that shape its weights (checked when a run starts from trained heads).

    Medusa   inputs: the final hidden state [B, T, H]; K heads -> logits [K, B, T, Vd];
             loss: medusa_distill_loss (training/losses.py)
    EAGLE-3  inputs: the fused taps [B, T, nH] + the next tokens' embeddings [B, T, H], unrolled
             ttt_steps (the training-time test) -> (logits [J, B, T, Vd], features [J, B, T, H]);
             loss: eagle_ttt_loss
    EAGLE    EAGLE-3 on the single final tap, over the full vocab, whose loss also regresses each
             step's feature onto the target's (heads.feature_loss_weight)

Shape legend: K heads, J draft steps, B batch, T positions, H hidden, nH taps x hidden, V vocab,
Vd draft vocab.
"""

from __future__ import annotations

import torch

from specheads.heads.draft_vocab import DEFAULT_DRAFT_VOCAB_SIZE
from specheads.heads.eagle3 import next_token_embeddings
from specheads.heads.artefacts.heads_dir import HeadsConfig, eagle_heads_config
from specheads.heads.target.adapter import TargetAdapter, TargetIdentity
from specheads.training.config import HeadsSpec, RecipeError
from specheads.training.features import frozen_target
from specheads.training.losses import DistillOutput, eagle_ttt_loss, medusa_distill_loss


class MedusaKind:
    """K Medusa heads on the target's final hidden state; head k at t predicts token t+k+2."""

    name = "medusa"
    # Config fields, beyond every kind's, that shape the weights -> the recipe key setting each.
    shape_keys = {"num_heads": "heads.num_heads", "num_layers": "heads.num_layers"}

    def __init__(self, spec: HeadsSpec):
        self.spec = spec
        self.num_depths = spec.num_heads

    def check_seq_len(self, seq_len: int) -> None:
        if seq_len < self.num_depths + 2:
            raise RecipeError(f"data.seq_len: expected at least heads.num_heads + 2 = {self.num_depths + 2} "
                              f"(head k scores position t against t+k+1), got {seq_len}")

    def heads_config(self, target: TargetAdapter, identity: TargetIdentity) -> HeadsConfig:
        """Medusa over the full vocab, or over a draft vocab when heads.draft_vocab_size is below it."""
        vocab = target.vocab_size
        draft_vocab = self.spec.draft_vocab_size if (self.spec.draft_vocab_size or vocab) < vocab else None
        return HeadsConfig(kind="medusa", hidden_size=target.hidden_size, vocab_size=vocab,
                           num_heads=self.spec.num_heads, num_layers=self.spec.num_layers,
                           tap_layers=[target.num_layers], target=identity, draft_vocab_size=draft_vocab)

    def takes_draft_vocab(self, heads) -> bool:
        """Whether the trainer sets the heads' draft vocab from the training tokens' counts."""
        return heads.truncated

    def inputs(self, taps_BTnH: torch.Tensor, input_ids_BT: torch.Tensor, target: TargetAdapter,
               dtype: torch.dtype) -> tuple:
        """The heads' forward arguments: the final hidden state [B, T, H] in the heads' dtype."""
        return (taps_BTnH.to(dtype),)

    def draft_logits(self, heads_out) -> torch.Tensor:
        return heads_out  # [K, B, T, Vd]

    def loss(self, heads_out, teacher, loss_mask_BT: torch.Tensor, draft_ids_V: torch.Tensor | None,
             inputs: tuple) -> DistillOutput:
        return medusa_distill_loss(heads_out, teacher, loss_mask_BT, draft_ids_V)


class Eagle3Kind:
    """An EAGLE-3 head (heads.num_layers decoder layers) on the fused taps, unrolled ttt_steps (the
    training-time test)."""

    name = "eagle3"
    shape_keys = {"num_layers": "heads.num_layers"}  # its num_heads is the draft steps, which unroll the same weights

    def __init__(self, spec: HeadsSpec):
        if spec.num_layers < 1:
            raise RecipeError("heads.num_layers: an EAGLE head needs at least one decoder layer, "
                              f"got {spec.num_layers}")
        self.spec = spec
        self.num_depths = spec.ttt_steps

    def check_seq_len(self, seq_len: int) -> None:
        if seq_len < self.num_depths + 2:
            raise RecipeError(f"data.seq_len: expected at least heads.ttt_steps + 2 = {self.num_depths + 2} "
                              f"(step j scores position t against t+1+j), got {seq_len}")

    def heads_config(self, target: TargetAdapter, identity: TargetIdentity) -> HeadsConfig:
        spec = self.spec
        config = eagle_heads_config(target, self.name, num_steps=spec.ttt_steps, tap_layers=spec.tap_layers,
                                    draft_vocab_size=spec.draft_vocab_size or DEFAULT_DRAFT_VOCAB_SIZE,
                                    num_attention_heads=spec.num_attention_heads, num_kv_heads=spec.num_kv_heads,
                                    intermediate_size=spec.intermediate_size, identity=identity,
                                    num_layers=spec.num_layers)
        try:
            target.check_taps(config.tap_layers)
        except ValueError as err:
            raise RecipeError(f"heads.tap_layers: {err}") from None
        return config

    def takes_draft_vocab(self, heads) -> bool:
        return True  # EAGLE-3 always predicts the most frequent training tokens (d2t/t2d)

    def inputs(self, taps_BTnH: torch.Tensor, input_ids_BT: torch.Tensor, target: TargetAdapter,
               dtype: torch.dtype) -> tuple:
        """The head's forward arguments: the concatenated taps [B, T, nH], the embeddings of tokens
        t+1 [B, T, H] (a lookup in the frozen target's table) and the steps to unroll."""
        off, no_grad = frozen_target(input_ids_BT.device)
        with off, no_grad:
            next_embeds_BTH = next_token_embeddings(target.embeddings(), input_ids_BT).to(dtype)
        return taps_BTnH.to(dtype), next_embeds_BTH, self.num_depths

    def draft_logits(self, heads_out) -> torch.Tensor:
        logits_JBTV, _ = heads_out
        return logits_JBTV

    def loss(self, heads_out, teacher, loss_mask_BT: torch.Tensor, draft_ids_V: torch.Tensor,
             inputs: tuple) -> DistillOutput:
        return eagle_ttt_loss(self.draft_logits(heads_out), teacher, loss_mask_BT, draft_ids_V,
                              self.spec.ttt_step_weight)


class EagleKind(Eagle3Kind):
    """EAGLE-1/2: one tap (the final hidden state), the full vocab, and each step's output feature
    regressed onto the target's feature at t+1+j."""

    name = "eagle"

    def takes_draft_vocab(self, heads) -> bool:
        return False  # the full vocab: its draft ids are the target ids

    def loss(self, heads_out, teacher, loss_mask_BT: torch.Tensor, draft_ids_V: torch.Tensor,
             inputs: tuple) -> DistillOutput:
        logits_JBTV, features_JBTH = heads_out
        taps_BTH = inputs[0].detach()  # the regression target: the target's own features, no gradient
        return eagle_ttt_loss(logits_JBTV, teacher, loss_mask_BT, draft_ids_V, self.spec.ttt_step_weight,
                              features_JBTH, taps_BTH, self.spec.feature_loss_weight)


KINDS = {"medusa": MedusaKind, "eagle3": Eagle3Kind, "eagle": EagleKind}
HeadKind = MedusaKind | Eagle3Kind


def head_kind(spec: HeadsSpec) -> HeadKind:
    """The recipe's head kind (heads.kind), chosen once per run."""
    return KINDS[spec.kind](spec)
