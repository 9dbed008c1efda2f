"""The SAPD objective: hand-computed values, the properties of docs/SAPD.md §8, loop-vs-vectorised."""

import math
from dataclasses import fields

import pytest
import torch

from sapd.method.objective import (
    OBJECTIVES,
    LossConfig,
    LossInputs,
    behaviour_weights,
    clipped_surrogate,
    kl_penalty,
    loss_config_for,
    loss_for,
    no_action_step_scores,
    reduce_loss,
    register_objective,
    required_inputs,
    rule_advantages,
    sapd_loss,
    sft_loss,
    step_advantages,
    step_scores,
    token_entropy,
    token_logprobs,
    token_signal,
)

DT = torch.float64


def _random_batch(P=3, G=4, T=7, seed=0, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(P, G, T, generator=g, dtype=dtype) * 3
    teacher = -torch.rand(P, G, T, generator=g, dtype=dtype) * 3
    new = old + 0.3 * torch.randn(P, G, T, generator=g, dtype=dtype)
    lengths = torch.randint(1, T + 1, (P, G), generator=g)
    resp = torch.arange(T).expand(P, G, T) < lengths.unsqueeze(-1)
    action = resp & (torch.rand(P, G, T, generator=g) < 0.4)
    rules = -torch.randint(0, 3, (P, G), generator=g).to(dtype)
    return new, old, teacher, resp, action, rules


def _inputs(new, old, teacher, resp, action, rules, advantage=None) -> LossInputs:
    return LossInputs(new, resp, old_logp_P_G_T=old, teacher_logp_P_G_T=teacher, action_mask_P_G_T=action,
                      rule_scores_P_G=rules, advantage_P_G=advantage)


# ----------------------------------------------------------------------------------- hand-computed


def test_hand_computed_joint_loss():
    # P=1, G=2, T=2; both responses two tokens long.
    old = torch.full((1, 2, 2), -1.0, dtype=DT)
    teacher = torch.tensor([[[-0.5, -1.0], [-2.0, -1.0]]], dtype=DT)  # d = [[0.5, 0], [-1, 0]]
    new = old + torch.log(torch.tensor([[[1.1, 1.1], [0.5, 0.5]]], dtype=DT))  # ρ = 1.1 and 0.5
    resp = torch.ones(1, 2, 2, dtype=torch.bool)
    action = torch.tensor([[[True, False], [True, False]]])  # r = [0.5, -1] → A_step = [0.75, -0.75]
    rules = torch.tensor([[0.0, -1.0]], dtype=DT)  # A_rule = ±0.5/(0.5+1e-6)
    loss, m = sapd_loss(new, old, teacher, resp, action, rules)

    # ρ=1.1 is inside [0.8, 1.2]; ρ=0.5 with a negative advantage takes the clipped 0.8·A.
    l_tok = -0.5 * ((1.1 * 0.15 * 0.5 + 0) / 2 + (0.8 * 0.15 * -1.0 + 0) / 2)
    l_step = -0.5 * (1.1 * 0.75 + 0.8 * -0.75)
    a = 0.5 / (0.5 + 1e-6)
    l_rule = -0.5 * (1.1 * a + 0.8 * -a)
    assert m["loss_tok"] == pytest.approx(l_tok, abs=1e-12)
    assert m["loss_step"] == pytest.approx(l_step, abs=1e-12)
    assert m["loss_rule"] == pytest.approx(l_rule, abs=1e-12)
    assert float(loss) == pytest.approx(0.1 * l_tok + 0.5 * l_step + 0.1 * l_rule, abs=1e-12)
    assert m["teacher_student_gap"] == pytest.approx((0.5 - 1.0) / 4)
    assert m["clip_fraction"] == pytest.approx(0.5)


def test_step_scores_and_advantages_by_hand():
    d = torch.tensor([[[1.0, 2.0, 3.0], [0.5, 0.5, 0.5], [4.0, 0.0, -1.0]]])
    mask = torch.tensor([[[1, 0, 1], [1, 1, 1], [0, 0, 1]]])
    r = step_scores(d, mask)
    assert r.tolist() == [[4.0, 1.5, -1.0]]
    adv = step_advantages(r)
    assert adv[0].tolist() == pytest.approx([4.0 - 1.5, 0.0, -2.5])
    std = math.sqrt((2.5**2 + 0 + 2.5**2) / 3)  # population std
    assert step_advantages(r, std_normalize=True)[0].tolist() == pytest.approx(
        [2.5 / (std + 1e-6), 0.0, -2.5 / (std + 1e-6)])


def test_rule_advantages_by_hand():
    rules = torch.tensor([[0.0, -1.0, -1.0, 0.0], [-2.0, -2.0, -2.0, -2.0]])
    adv = rule_advantages(rules)
    a = 0.5 / (0.5 + 1e-6)
    assert adv[0].tolist() == pytest.approx([a, -a, -a, a])
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # a uniform group carries no rule signal


@pytest.mark.parametrize("ratio,adv,expected", [
    (1.5, 1.0, 1.2),    # positive advantage: capped at 1+ε
    (0.5, 1.0, 0.5),    # positive advantage, low ratio: unclipped (min picks ρA)
    (0.5, -1.0, -0.8),  # negative advantage, low ratio: capped at (1−ε)A
    (1.5, -1.0, -1.5),  # negative advantage, high ratio: unclipped (pessimistic)
    (1.1, 2.0, 2.2),
])
def test_clipped_surrogate_cases(ratio, adv, expected):
    out = clipped_surrogate(torch.tensor([ratio]), torch.tensor([adv]), clip_eps=0.2)
    assert float(out) == pytest.approx(expected)


def test_reduction_per_response_length_normalisation():
    values = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    # seq_mean_token_mean: (4/4 + 4/2) / 2 ; token_mean: 8 / 6
    assert float(reduce_loss(values, mask)) == pytest.approx(1.5)
    assert float(reduce_loss(values, mask, "token_mean")) == pytest.approx(8 / 6)
    with pytest.raises(ValueError, match="unknown reduction"):
        reduce_loss(values, mask, "sum")  # type: ignore[arg-type]


def test_token_logprobs_matches_log_softmax():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, 11, generator=g)
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, tokens), ref)


def test_sft_loss_is_mean_negative_log_likelihood():
    logp = torch.tensor([[-1.0, -3.0, -50.0], [-2.0, -2.0, -2.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    loss, m = sft_loss(logp, mask)
    assert float(loss) == pytest.approx((2.0 + 2.0) / 2)
    assert m["loss_sft"] == pytest.approx(2.0)


# ----------------------------------------------------------------------------- docs/SAPD.md §8 properties


def test_offset_invariance_is_exact():
    # §8.1 with dyadic values, exactly representable, so equality is bitwise.
    r = torch.tensor([[0.5, -1.25, 2.0, 0.125], [3.0, 3.0, -0.5, 1.0]], dtype=DT)
    b = torch.tensor([[7.0], [-1024.0]], dtype=DT)
    assert torch.equal(step_advantages(r + b), step_advantages(r))
    # and in random float64 values to rounding
    g = torch.Generator().manual_seed(3)
    r = torch.randn(16, 8, generator=g, dtype=DT)
    b = 100 * torch.randn(16, 1, generator=g, dtype=DT)
    torch.testing.assert_close(step_advantages(r + b), step_advantages(r), atol=1e-12, rtol=0)


def test_offset_invariance_through_the_step_loss():
    new, old, teacher, resp, action, rules = _random_batch(seed=4)
    P, G, T = resp.shape
    # make every response have at least one action token, then shift each response's first action token
    # by the same per-group constant b(h): every rᵢ moves by b(h), so L_step and its gradient must not move.
    action[..., 0] = resp[..., 0]
    shift = torch.zeros_like(teacher)
    shift[..., 0] = torch.tensor([5.0, -3.0, 11.0], dtype=DT).view(P, 1)
    kw = dict(lambda_tok=0.0, lambda_rule=0.0)
    new1 = new.clone().requires_grad_(True)
    new2 = new.clone().requires_grad_(True)
    loss1, m1 = sapd_loss(new1, old, teacher, resp, action, rules, LossConfig(**kw))
    loss2, m2 = sapd_loss(new2, old, teacher + shift, resp, action, rules, LossConfig(**kw))
    loss1.backward()
    loss2.backward()
    assert m1["loss_step"] == pytest.approx(m2["loss_step"], abs=1e-12)
    torch.testing.assert_close(new1.grad, new2.grad, atol=1e-12, rtol=0)
    # ...whereas the std-normalised variant is also invariant, but the token loss is not:
    _, m3 = sapd_loss(new, old, teacher + shift, resp, action, rules)
    _, m4 = sapd_loss(new, old, teacher, resp, action, rules)
    assert m3["loss_tok"] != pytest.approx(m4["loss_tok"], abs=1e-6)


def test_projection_zero_sum_and_bounds():
    g = torch.Generator().manual_seed(5)
    r = torch.randn(32, 8, generator=g, dtype=DT)
    adv = step_advantages(r)
    torch.testing.assert_close(adv.sum(-1), torch.zeros(32, dtype=DT), atol=1e-12, rtol=0)
    for _ in range(20):
        b = 5 * torch.randn(32, 1, generator=g, dtype=DT)
        assert bool((adv.norm(dim=-1) <= (r - b).norm(dim=-1) + 1e-12).all())
    # perturbation: |eᵢ| ≤ ε ⇒ |Aᵢ(r+e) − Aᵢ(r)| ≤ 2ε
    eps = 0.01
    e = (torch.rand(32, 8, generator=g, dtype=DT) * 2 - 1) * eps
    assert float((step_advantages(r + e) - adv).abs().max()) <= 2 * eps + 1e-12


def test_no_amplification_of_weak_differences():
    g = torch.Generator().manual_seed(6)
    G = 8
    v = torch.randn(1, G, generator=g, dtype=DT)
    b = 3.0
    pv = v - v.mean()
    prev = None
    for alpha in [1.0, 1e-2, 1e-4, 1e-6]:
        r = b + alpha * v
        adv = step_advantages(r)
        torch.testing.assert_close(adv, alpha * pv, atol=1e-9, rtol=1e-6)
        norm = float(adv.norm())
        if prev is not None:
            assert norm < prev
        prev = norm
        if alpha >= 1e-4:  # far above η: the standardised variant blows weak differences up to ≈ √G
            assert float(step_advantages(r, std_normalize=True).norm()) == pytest.approx(math.sqrt(G), rel=1e-2)
    assert prev < 1e-5


def test_padding_and_masking_never_leak():
    new, old, teacher, resp, action, rules = _random_batch(seed=7)
    pad = ~resp
    # garbage (including non-finite values) on padding must not change anything
    bad_teacher = teacher.masked_fill(pad, float("nan"))
    bad_old = old.masked_fill(pad, 1e6)
    bad_new = new.masked_fill(pad, -1e6)
    bad_action = action | pad  # action bits on padding are ignored (intersected with the response)
    n1 = new.clone().requires_grad_(True)
    n2 = bad_new.clone().requires_grad_(True)
    l1, m1 = sapd_loss(n1, old, teacher, resp, action, rules)
    l2, m2 = sapd_loss(n2, bad_old, bad_teacher, resp, bad_action, rules)
    l1.backward()
    l2.backward()
    assert math.isfinite(float(l2.detach()))
    assert float(l1) == pytest.approx(float(l2), abs=1e-12)
    assert bool((n2.grad[pad] == 0).all())
    torch.testing.assert_close(n1.grad, n2.grad, atol=1e-12, rtol=0)


def test_step_scores_use_only_action_tokens_unless_full_token_scoring():
    new, old, teacher, resp, action, rules = _random_batch(seed=8)
    non_action = resp & ~action
    changed = teacher + non_action.to(DT) * 2.0
    kw = dict(lambda_tok=0.0, lambda_rule=0.0)
    _, a = sapd_loss(new, old, teacher, resp, action, rules, LossConfig(**kw))
    _, b = sapd_loss(new, old, changed, resp, action, rules, LossConfig(**kw))
    assert a["loss_step"] == pytest.approx(b["loss_step"], abs=1e-12)
    _, c = sapd_loss(new, old, teacher, resp, action, rules, LossConfig(full_token_scoring=True, **kw))
    _, d = sapd_loss(new, old, changed, resp, action, rules, LossConfig(full_token_scoring=True, **kw))
    assert c["loss_step"] != pytest.approx(d["loss_step"], abs=1e-6)


def test_prefix_tokens_receive_no_gradient():
    # A full sequence = prompt (4 tokens) + response (5 tokens). Only response positions enter the loss, so
    # the gradient w.r.t. the log-probs of prompt positions is exactly zero.
    g = torch.Generator().manual_seed(9)
    P, G, S, prompt_len = 2, 3, 9, 4
    full_new = (-torch.rand(P, G, S, generator=g, dtype=DT)).requires_grad_(True)
    old = full_new.detach()[..., prompt_len:] + 0.1 * torch.randn(P, G, S - prompt_len, generator=g, dtype=DT)
    teacher = -torch.rand(P, G, S - prompt_len, generator=g, dtype=DT)
    resp = torch.ones(P, G, S - prompt_len, dtype=torch.bool)
    action = torch.zeros_like(resp)
    action[..., 1:3] = True
    rules = torch.tensor([[0.0, -1.0, 0.0], [-1.0, -1.0, 0.0]], dtype=DT)
    loss, _ = sapd_loss(full_new[..., prompt_len:], old, teacher, resp, action, rules)
    loss.backward()
    assert bool((full_new.grad[..., :prompt_len] == 0).all())
    assert bool((full_new.grad[..., prompt_len:] != 0).any())


def test_ratio_is_one_at_theta_old_and_clipping_is_inactive():
    _, old, teacher, resp, action, rules = _random_batch(seed=10)
    new = old.clone().requires_grad_(True)
    loss, m = sapd_loss(new, old, teacher, resp, action, rules)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    assert m["clip_fraction"] == 0.0
    # the unclipped objective at ρ = 1 is just −reduce(A) per term
    d = token_signal(teacher, old, resp)
    a_step = step_advantages(step_scores(d, action)).unsqueeze(-1).expand_as(d)
    a_rule = rule_advantages(rules).unsqueeze(-1).expand_as(d)
    total_adv = 0.1 * 0.15 * d + 0.5 * a_step + 0.1 * a_rule
    unclipped = -reduce_loss(total_adv, resp)
    assert float(loss) == pytest.approx(float(unclipped), abs=1e-12)
    loss.backward()
    # d loss / d new_logp = −A_total / Lᵢ / (P·G) on response tokens (d ρ/d logp = ρ = 1)
    P, G, _ = resp.shape
    lengths = resp.sum(-1, keepdim=True).to(DT)
    expected = torch.where(resp, -total_adv / lengths / (P * G), torch.zeros_like(d))
    torch.testing.assert_close(new.grad, expected, atol=1e-12, rtol=0)


def test_zero_loss_when_student_equals_teacher_and_rules_are_uniform():
    _, old, _, resp, action, _ = _random_batch(seed=11)
    rules = torch.zeros(resp.shape[:2], dtype=DT)
    loss, m = sapd_loss(old.clone(), old, old.clone(), resp, action, rules)
    assert float(loss) == 0.0
    assert m["teacher_student_gap"] == 0.0


# --------------------------------------------------------------------------- loop vs vectorised


def _loop_reference(new, old, teacher, resp, action, rules, *, lambda_tok=0.1, lambda_step=0.5,
                    lambda_rule=0.1, token_scale=0.15, clip_eps=0.2, full_token_scoring=False,
                    std_normalize_step=False, eps=1e-6, no_action_step="zero", no_action_penalty=1.0,
                    dual_clip=None, reduction="seq_mean_token_mean", **_):
    """docs/SAPD.md §3 written as plain Python loops over prefixes, responses and tokens."""
    P, G, T = resp.shape

    def clip_obj(rho, a):
        obj = min(rho * a, min(max(rho, 1 - clip_eps), 1 + clip_eps) * a)
        return max(obj, dual_clip * a) if dual_clip is not None and a < 0 else obj

    def pop_std(xs):
        mu = sum(xs) / len(xs)
        return math.sqrt(sum((x - mu) ** 2 for x in xs) / len(xs))

    tot = {"tok": 0.0, "step": 0.0, "rule": 0.0}
    n_tokens = sum(1 for p in range(P) for i in range(G) for k in range(T) if resp[p, i, k])
    for p in range(P):
        d = [[float(teacher[p, i, k] - old[p, i, k]) if resp[p, i, k] else 0.0 for k in range(T)]
             for i in range(G)]
        has_action = [any(action[p, i, k] and resp[p, i, k] for k in range(T)) for i in range(G)]
        r, in_group = [], []
        for i in range(G):
            whole = sum(d[i][k] for k in range(T) if resp[p, i, k])
            acted = sum(d[i][k] for k in range(T) if action[p, i, k] and resp[p, i, k])
            if full_token_scoring:
                r.append(whole)
            elif has_action[i] or no_action_step in ("zero", "exclude"):
                r.append(acted)
            elif no_action_step == "penalty":
                r.append(-no_action_penalty)
            else:  # whole_response
                r.append(whole)
            in_group.append(full_token_scoring or no_action_step != "exclude" or has_action[i])
        members = [r[i] for i in range(G) if in_group[i]]
        rbar = sum(members) / len(members) if members else 0.0
        a_step = [r[i] - rbar if in_group[i] else 0.0 for i in range(G)]
        if std_normalize_step:
            s = math.sqrt(sum(a * a for a in a_step) / max(len(members), 1))
            a_step = [a / (s + eps) for a in a_step]
        rule = [float(x) for x in rules[p]]
        rule_bar, rule_std = sum(rule) / G, pop_std(rule)
        a_rule = [(x - rule_bar) / (rule_std + eps) for x in rule]
        for i in range(G):
            ks = [k for k in range(T) if resp[p, i, k]]
            # seq_mean_token_mean: 1/Lᵢ per response, mean over P·G; token_mean: 1/(all tokens of the batch)
            w = 1 / (max(len(ks), 1) * P * G) if reduction == "seq_mean_token_mean" else 1 / n_tokens
            rhos = {k: math.exp(float(new[p, i, k] - old[p, i, k])) for k in ks}
            tot["tok"] += w * sum(clip_obj(rhos[k], token_scale * d[i][k]) for k in ks)
            tot["step"] += w * sum(clip_obj(rhos[k], a_step[i]) for k in ks)
            tot["rule"] += w * sum(clip_obj(rhos[k], a_rule[i]) for k in ks)
    l_tok, l_step, l_rule = -tot["tok"], -tot["step"], -tot["rule"]
    return lambda_tok * l_tok + lambda_step * l_step + lambda_rule * l_rule, (l_tok, l_step, l_rule)


@pytest.mark.parametrize("variant", ["sapd", "opd", "opd_rule", "wo_opd", "wo_rule", "full_token", "std_norm",
                                     "sapd_exclude", "sapd_penalty", "sapd_whole", "sapd_paper"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_loop_equals_vectorised(variant, seed):
    new, old, teacher, resp, action, rules = _random_batch(P=3, G=4, T=6, seed=seed)
    new = old + 1.5 * (new - old)  # ratios well outside [0.8, 1.2], so clipping and dual-clip both bind
    cfg = loss_config_for(variant)
    loss, m = loss_for(cfg, _inputs(new, old, teacher, resp, action, rules))
    ref, (l_tok, l_step, l_rule) = _loop_reference(new, old, teacher, resp, action, rules,
                                                   **{f.name: getattr(cfg, f.name) for f in fields(cfg)})
    assert float(loss) == pytest.approx(ref, abs=1e-10)
    assert (m["loss_tok"], m["loss_step"], m["loss_rule"]) == pytest.approx((l_tok, l_step, l_rule), abs=1e-10)


@pytest.mark.parametrize("options", [{"dual_clip": 3.0}, {"reduction": "token_mean"},
                                     {"dual_clip": 1.5, "reduction": "token_mean", "no_action_step": "penalty",
                                      "no_action_penalty": 0.3}])
@pytest.mark.parametrize("seed", [0, 1])
def test_loop_equals_vectorised_with_sdar_options(options, seed):
    new, old, teacher, resp, action, rules = _random_batch(P=3, G=4, T=6, seed=seed)
    new = old + 4.0 * (new - old)
    cfg = loss_config_for("sapd", **options)
    loss, m = loss_for(cfg, _inputs(new, old, teacher, resp, action, rules))
    ref, parts = _loop_reference(new, old, teacher, resp, action, rules,
                                 **{f.name: getattr(cfg, f.name) for f in fields(cfg)})
    assert float(loss) == pytest.approx(ref, abs=1e-10)
    assert (m["loss_tok"], m["loss_step"], m["loss_rule"]) == pytest.approx(parts, abs=1e-10)
    assert float(loss) != pytest.approx(float(loss_for(loss_config_for("sapd"),
                                                       _inputs(new, old, teacher, resp, action, rules))[0]),
                                        abs=1e-6)  # the option changes the loss


# ------------------------------------------------------------------------------------- variants


def test_variants_set_the_documented_knobs():
    assert loss_config_for("sapd") == LossConfig()
    assert (loss_config_for("opd").lambda_step, loss_config_for("opd").lambda_rule) == (0.0, 0.0)
    assert loss_config_for("opd_rule").lambda_step == 0.0 and loss_config_for("opd_rule").lambda_rule == 0.1
    assert loss_config_for("wo_opd").lambda_tok == 0.0
    assert loss_config_for("wo_rule").lambda_rule == 0.0
    assert loss_config_for("full_token").full_token_scoring
    assert loss_config_for("std_norm").std_normalize_step
    assert loss_config_for("sft").objective == "sft"
    assert loss_config_for("sapd", clip_eps=0.3).clip_eps == 0.3
    with pytest.raises(ValueError, match="unknown variant"):
        loss_config_for("ppo")
    with pytest.raises(ValueError, match="unknown loss option"):
        loss_config_for("sapd", lambda_kl=1.0)
    new, old, teacher, resp, action, rules = _random_batch()
    # sft through the registry: the recorded responses' cross-entropy, nothing else read
    sft, m = loss_for(loss_config_for("sft"), LossInputs(new, resp))
    assert float(sft) == float(sft_loss(new, resp)[0]) and m["loss_sft"] == float(sft)
    with pytest.raises(ValueError, match=r"objective must be one of \['grpo', 'sapd', 'sft'"):
        loss_for(LossConfig(objective="ppo"), _inputs(new, old, teacher, resp, action, rules))


def test_opd_variant_gradient_ignores_step_and_rule_signals():
    new, old, teacher, resp, action, rules = _random_batch(seed=12)
    n1 = new.clone().requires_grad_(True)
    n2 = new.clone().requires_grad_(True)
    cfg = loss_config_for("opd")
    loss_for(cfg, _inputs(n1, old, teacher, resp, action, rules))[0].backward()
    loss_for(cfg, _inputs(n2, old, teacher, resp, ~action & resp, rules * 0 - 5))[0].backward()
    torch.testing.assert_close(n1.grad, n2.grad, atol=1e-12, rtol=0)


# ------------------------------------------------------------------- responses without an action


def test_a_response_without_action_tokens_outscores_the_group_as_eq6_is_written():
    """Eq. 6 gives an empty action mask rᵢ = 0; when the student is more confident than the teacher on its
    own samples (d < 0, the usual case: E[d] = −KL), the malformed response gets the best advantage."""
    r = step_scores(torch.tensor([[[-1.0, -2.0], [-0.5, -0.5], [-3.0, -3.0]]], dtype=DT),
                    torch.tensor([[[1, 1], [1, 0], [0, 0]]], dtype=torch.bool))
    assert r.tolist() == [[-3.0, -0.5, 0.0]]
    adv = step_advantages(r)
    assert int(adv.argmax()) == 2 and float(adv[0, 2]) == pytest.approx(3.5 / 3)


def test_exclude_takes_no_action_responses_out_of_the_step_group():
    r = torch.tensor([[-3.0, -0.5, 0.0, 7.0]], dtype=DT)
    scored = torch.tensor([[True, True, False, False]])
    adv = step_advantages(r, scored_P_G=scored)
    assert adv[0].tolist() == pytest.approx([-1.25, 1.25, 0.0, 0.0])
    std = step_advantages(r, std_normalize=True, scored_P_G=scored)
    assert std[0].tolist() == pytest.approx([-1.0, 1.0, 0.0, 0.0], abs=1e-5)
    # a group with no scored response has no step advantage at all
    assert step_advantages(r, scored_P_G=torch.zeros_like(scored)).abs().sum() == 0


def test_exclude_equals_zero_when_every_response_has_an_action_and_changes_it_otherwise():
    new, old, teacher, resp, action, rules = _random_batch(seed=21)
    action = action.clone()
    action[..., 0] = resp[..., 0]  # every response has at least one action token
    a, ma = sapd_loss(new, old, teacher, resp, action, rules)
    b, mb = sapd_loss(new, old, teacher, resp, action, rules, LossConfig(no_action_step="exclude"))
    assert float(a) == pytest.approx(float(b), abs=1e-12) and ma["no_action_fraction"] == 0.0
    action[0, 1] = False  # one malformed response
    a, ma = sapd_loss(new, old, teacher, resp, action, rules)
    b, _ = sapd_loss(new, old, teacher, resp, action, rules, LossConfig(no_action_step="exclude"))
    assert float(a) != pytest.approx(float(b), abs=1e-9) and ma["no_action_fraction"] == pytest.approx(1 / 12)
    assert loss_config_for("sapd_exclude").no_action_step == "exclude"
    with pytest.raises(ValueError, match="no_action_step"):
        sapd_loss(new, old, teacher, resp, action, rules, LossConfig(no_action_step="drop"))


# ------------------------------------------- the no-action treatments and SDAR's regularisers, by hand


def _no_action_batch():
    """P=1, G=3, T=2, every response two tokens; response 2 has no action tokens.
    d = [[-1, -1], [0, -0.5], [-2, -3]]; action masks cover token 0 of responses 0 and 1."""
    old = torch.full((1, 3, 2), -1.0, dtype=DT)
    teacher = old + torch.tensor([[[-1.0, -1.0], [0.0, -0.5], [-2.0, -3.0]]], dtype=DT)
    resp = torch.ones(1, 3, 2, dtype=torch.bool)
    action = torch.tensor([[[True, False], [True, False], [False, False]]])
    return old.clone(), old, teacher, resp, action, torch.zeros(1, 3, dtype=DT)


@pytest.mark.parametrize("treatment,penalty,expected_r", [
    ("zero", 1.0, [-1.0, 0.0, 0.0]),            # Eq. 6 as written: the action-less response scores 0
    ("exclude", 1.0, [-1.0, 0.0, 0.0]),         # scored 0 but outside the group (A = 0, r̄ over the others)
    ("penalty", 1.0, [-1.0, 0.0, -1.0]),        # SDAR: −penalty inside r
    ("penalty", 0.1, [-1.0, 0.0, -0.1]),
    ("whole_response", 1.0, [-1.0, 0.0, -5.0]),  # d summed over its whole text
])
def test_no_action_treatments_by_hand(treatment, penalty, expected_r):
    new, old, teacher, resp, action, rules = _no_action_batch()
    cfg = loss_config_for("sapd", no_action_step=treatment, no_action_penalty=penalty)
    loss, m = sapd_loss(new, old, teacher, resp, action, rules, cfg)
    assert m["step_score_mean"] == pytest.approx(sum(expected_r) / 3)
    # at θ = θ_old (ρ = 1) every token of response i carries Aᵢ, so L_step = −mean(A) = 0 for a centred
    # group; check the advantages themselves through the token-level gradient instead
    n = new.clone().requires_grad_(True)
    sapd_loss(n, old, teacher, resp, action, rules, loss_config_for("wo_opd", lambda_rule=0.0, **{
        "no_action_step": treatment, "no_action_penalty": penalty}))[0].backward()
    if treatment == "exclude":
        adv = [-0.5, 0.5, 0.0]
    else:
        mean = sum(expected_r) / 3
        adv = [x - mean for x in expected_r]
    # ∂L/∂log π_{i,k} = −λ_step · Aᵢ / (Lᵢ · G)  (ρ = 1 is inside the clip range)
    expected_grad = [[-0.5 * a / (2 * 3)] * 2 for a in adv]
    torch.testing.assert_close(n.grad[0], torch.tensor(expected_grad, dtype=DT), atol=1e-12, rtol=0)
    assert m["no_action_fraction"] == pytest.approx(1 / 3) and m["all_no_action_groups"] == 0.0


def test_penalty_and_whole_response_put_the_action_less_response_below_the_group():
    """The point of both treatments: where "zero" ranks the malformed response first, they rank it last."""
    new, old, teacher, resp, action, rules = _no_action_batch()
    teacher = teacher.clone()
    teacher[0, 1, 0] = -2.0  # response 1 now scores r = −1 as well: both well-formed responses have d < 0
    for treatment, best_is_malformed in (("zero", True), ("penalty", False), ("whole_response", False)):
        cfg = loss_config_for("sapd", no_action_step=treatment, no_action_penalty=2.0)
        d = token_signal(teacher, old, resp)
        r, scored = no_action_step_scores(d, action & resp, resp, cfg)
        adv = step_advantages(r, scored_P_G=scored)
        assert (int(adv.argmax()) == 2) is best_is_malformed, treatment


def test_a_group_without_any_action_is_counted_and_penalty_gives_it_no_step_signal():
    new, old, teacher, resp, action, rules = _no_action_batch()
    none = torch.zeros_like(action)
    for treatment in ("zero", "penalty"):
        _, m = sapd_loss(new, old, teacher, resp, none, rules, loss_config_for("sapd", no_action_step=treatment))
        assert m["all_no_action_groups"] == 1.0 and m["no_action_fraction"] == 1.0
        assert m["step_adv_abs_mean"] == 0.0  # equal penalties centre to 0: only whole_response ranks them
    _, m = sapd_loss(new, old, teacher, resp, none, rules, loss_config_for("sapd", no_action_step="whole_response"))
    # r = [−2, −0.5, −5], r̄ = −2.5 → |A| = [0.5, 2, 2.5]
    assert m["step_adv_abs_mean"] == pytest.approx(5.0 / 3)


@pytest.mark.parametrize("ratio,adv,c,expected", [
    (5.0, -1.0, 3.0, -3.0),   # A < 0, ρ far above 1+ε: plain clip gives −5, dual-clip bounds it at c·A
    (2.0, -1.0, 3.0, -2.0),   # ρ below c: unchanged
    (5.0, 1.0, 3.0, 1.2),     # A > 0: dual-clip never applies
    (0.5, -1.0, 3.0, -0.8),
    (5.0, -2.0, 1.5, -3.0),
])
def test_dual_clip_by_hand(ratio, adv, c, expected):
    out = clipped_surrogate(torch.tensor([ratio]), torch.tensor([adv]), clip_eps=0.2, dual_clip=c)
    assert float(out) == pytest.approx(expected)


def test_dual_clip_through_the_loss_and_its_fraction():
    # P=1, G=2, T=1: ρ = 5 on response 0 with A_step = −0.5, ρ = 1 on response 1 with A_step = +0.5
    old = torch.full((1, 2, 1), -1.0, dtype=DT)
    new = old + torch.log(torch.tensor([[[5.0], [1.0]]], dtype=DT))
    teacher = old + torch.tensor([[[-1.0], [0.0]]], dtype=DT)  # d = [−1, 0] → r = [−1, 0] → A = [−0.5, 0.5]
    resp = torch.ones(1, 2, 1, dtype=torch.bool)
    cfg = loss_config_for("wo_opd", lambda_rule=0.0, dual_clip=3.0)
    _, m = sapd_loss(new, old, teacher, resp, resp, torch.zeros(1, 2, dtype=DT), cfg)
    assert m["loss_step"] == pytest.approx(-(max(5 * -0.5, 3 * -0.5) + 0.5) / 2)  # −(−1.5 + 0.5)/2 = 0.5
    _, plain = sapd_loss(new, old, teacher, resp, resp, torch.zeros(1, 2, dtype=DT),
                         loss_config_for("wo_opd", lambda_rule=0.0))
    assert plain["loss_step"] == pytest.approx(-(5 * -0.5 + 0.5) / 2)  # 1.0
    assert m["dual_clip_fraction"] == pytest.approx(0.5)


def test_low_var_kl_and_k1_by_hand_with_gradient():
    new = torch.tensor([[[-1.0, -2.0]]], dtype=DT, requires_grad=True)
    ref = torch.tensor([[[-2.0, -2.0]]], dtype=DT)
    k3 = kl_penalty(new, ref, "low_var_kl")
    # x = ref − new = [−1, 0]: eˣ − x − 1 = [e⁻¹, 0]
    assert k3[0, 0].tolist() == pytest.approx([math.exp(-1), 0.0])
    k3.sum().backward()
    assert new.grad[0, 0].tolist() == pytest.approx([1 - math.exp(-1), 0.0])  # ∂/∂new = 1 − eˣ
    assert kl_penalty(new, ref, "kl")[0, 0].tolist() == pytest.approx([1.0, 0.0])
    # the clamp: a token 30 nats below the reference contributes at most 10
    assert float(kl_penalty(torch.tensor([-1.0]), torch.tensor([29.0]))) == pytest.approx(10.0)


def test_kl_to_the_initial_policy_adds_coef_times_the_reduced_kl():
    new, old, teacher, resp, action, rules = _no_action_batch()
    new = new.clone()
    new[0, 0, 0] = -2.0  # one token 1 nat below the reference (= old here): x = ref − new = +1
    ref = old.clone()
    base, _ = sapd_loss(new, old, teacher, resp, action, rules)
    cfg = loss_config_for("sapd", kl_coef=0.01)
    with pytest.raises(ValueError, match="kl_coef"):
        sapd_loss(new, old, teacher, resp, action, rules, cfg)
    loss, m = sapd_loss(new, old, teacher, resp, action, rules, cfg, ref_logp_P_G_T=ref)
    k3 = math.exp(1.0) - 1.0 - 1.0  # x = ref − new = +1
    kl = (k3 / 2) / 3  # 1/Lᵢ over response 0, then the mean over G = 3
    assert m["loss_kl"] == pytest.approx(kl)
    assert float(loss) == pytest.approx(float(base) + 0.01 * kl, abs=1e-12)


def test_entropy_bonus_subtracts_coef_times_the_reduced_entropy():
    new, old, teacher, resp, action, rules = _no_action_batch()
    logits = torch.zeros(1, 3, 2, 4, dtype=DT, requires_grad=True)  # uniform over 4 tokens: H = ln 4
    ent = token_entropy(logits)
    assert ent.flatten().tolist() == pytest.approx([math.log(4)] * 6)
    base, _ = sapd_loss(new, old, teacher, resp, action, rules)
    cfg = loss_config_for("sapd", entropy_coef=0.001)
    with pytest.raises(ValueError, match="entropy_coef"):
        sapd_loss(new, old, teacher, resp, action, rules, cfg)
    loss, m = sapd_loss(new, old, teacher, resp, action, rules, cfg, entropy_P_G_T=ent)
    assert m["loss_entropy"] == pytest.approx(math.log(4))
    assert float(loss) == pytest.approx(float(base) - 0.001 * math.log(4), abs=1e-12)
    loss.backward()  # uniform logits are the entropy maximum: no gradient from the bonus
    assert float(logits.grad.abs().max()) < 1e-12


def test_token_mean_aggregation_by_hand():
    # responses of 1 and 3 tokens; token term only, ρ = 1: L_tok = −β·mean(d) under each aggregation
    old = torch.full((1, 2, 3), -1.0, dtype=DT)
    teacher = old + torch.tensor([[[3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]], dtype=DT)
    resp = torch.tensor([[[True, False, False], [True, True, True]]])
    rules = torch.zeros(1, 2, dtype=DT)
    _, seq = sapd_loss(old, old, teacher, resp, resp, rules, loss_config_for("opd"))
    _, tok = sapd_loss(old, old, teacher, resp, resp, rules, loss_config_for("opd", reduction="token_mean"))
    assert seq["loss_tok"] == pytest.approx(-0.15 * (3.0 / 1 + 0.0 / 3) / 2)  # −0.225
    assert tok["loss_tok"] == pytest.approx(-0.15 * 3.0 / 4)  # −0.1125


def test_new_variants_and_their_validation():
    sdar = loss_config_for("sapd_sdar")
    assert (sdar.no_action_step, sdar.no_action_penalty, sdar.kl_coef, sdar.kl_type, sdar.entropy_coef,
            sdar.dual_clip, sdar.reduction) == ("penalty", 0.1, 0.01, "low_var_kl", 0.001, 3.0, "token_mean")
    assert loss_config_for("sapd_paper") == LossConfig()  # today's default is the paper's literal form
    assert loss_config_for("sapd_penalty").no_action_step == "penalty"
    assert loss_config_for("sapd_whole").no_action_step == "whole_response"
    for bad in ({"dual_clip": 1.0}, {"kl_coef": -0.1}, {"no_action_penalty": -1.0}, {"kl_type": "mse"},
                {"reduction": "sum"}):
        with pytest.raises(ValueError):
            loss_config_for("sapd", **bad)


# ----------------------------------------------------------------------------- the objectives' registry


def test_the_registry_derives_what_each_objective_reads():
    assert sorted(OBJECTIVES) == ["grpo", "sapd", "sft"]
    assert required_inputs(loss_config_for("sapd")) == {"new_logp_P_G_T", "response_mask_P_G_T", "old_logp_P_G_T",
                                                        "teacher_logp_P_G_T", "action_mask_P_G_T", "rule_scores_P_G"}
    sdar = required_inputs(loss_config_for("sapd_sdar"))  # its KL and entropy terms add their inputs
    assert {"ref_logp_P_G_T", "entropy_P_G_T"} <= sdar
    assert required_inputs(loss_config_for("sft")) == {"new_logp_P_G_T", "response_mask_P_G_T"}
    assert required_inputs(loss_config_for("sft", kl_coef=0.1)) == {"new_logp_P_G_T", "response_mask_P_G_T"}
    assert "advantage_P_G" in required_inputs(loss_config_for("grpo"))
    assert (OBJECTIVES["sapd"].data, OBJECTIVES["sft"].data, OBJECTIVES["grpo"].data) == ("scored", "recorded",
                                                                                          "online")
    new, old, teacher, resp, action, rules = _random_batch()
    with pytest.raises(ValueError, match="needs teacher_logp_P_G_T"):
        loss_for(loss_config_for("sapd"), LossInputs(new, resp, old_logp_P_G_T=old, action_mask_P_G_T=action,
                                                      rule_scores_P_G=rules))
    with pytest.raises(ValueError, match="unknown variant"):
        loss_config_for("toy")


def test_register_objective_checks_the_function(monkeypatch):
    monkeypatch.setattr("sapd.method.objective.OBJECTIVES", dict(OBJECTIVES))
    with pytest.raises(TypeError, match="only LossInputs fields"):
        register_objective("bad")(lambda new_logp_P_G_T, response_mask_P_G_T, teacher_logp, cfg: None)
    with pytest.raises(ValueError, match="registered already"):
        register_objective("sapd")(sapd_loss)


# --------------------------------------------------------------------------- a stale round (train.overlap: one_step)


def _one_token_group(tokens: list[str], p_old: dict[str, float], p_behaviour: dict[str, float],
                     p_teacher: dict[str, float]):
    """G one-token responses over a two-token vocabulary: (old, behaviour, teacher, response mask), P = 1."""
    lg = lambda table: torch.log(torch.tensor([[[table[t]] for t in tokens]], dtype=DT))  # noqa: E731
    return lg(p_old), lg(p_behaviour), lg(p_teacher), torch.ones(1, len(tokens), 1, dtype=torch.bool)


def test_behaviour_weights_turn_a_stale_group_into_the_on_policy_token_term():
    """π_old = (½, ½) over tokens A, B; the stale round was sampled by μ = (¼, ¾). A group drawn in exact
    proportion to μ (A, B, B, B), each token weighted by w = π_old/μ (2 and ⅔), gives the on-policy group's
    (A, A, B, B) token loss and the same gradient per token at θ = θ_old: the weighted objective is the
    on-policy one in expectation (here exactly)."""
    old, teacher = {"A": 0.5, "B": 0.5}, {"A": 0.8, "B": 0.2}
    stale = _one_token_group(list("ABBB"), old, {"A": 0.25, "B": 0.75}, teacher)
    fresh = _one_token_group(list("AABB"), old, old, teacher)
    cfg = LossConfig(lambda_step=0.0, lambda_rule=0.0, lambda_tok=1.0)
    losses, grads = [], []
    for (o, mu, t, resp), weighted in ((stale, True), (fresh, False)):
        new = o.clone().requires_grad_(True)
        no_action = torch.zeros_like(resp)
        loss, m = sapd_loss(new, o, t, resp, no_action, torch.zeros(1, resp.shape[1], dtype=DT), cfg,
                            behaviour_logp_P_G_T=mu if weighted else None)
        loss.backward()
        losses.append(float(loss.detach()))
        g = new.grad.flatten().tolist()
        grads.append((g[0] + (g[1] if not weighted else 0.0), sum(g[1:]) if weighted else g[2] + g[3]))
        if weighted:
            assert m["behaviour_weight_mean"] == pytest.approx((2 + 3 * 2 / 3) / 4)
            assert m["ratio_mean"] == 1.0  # ρ is measured against π_old: it starts at 1 however stale the round
    d_a, d_b = math.log(0.8 / 0.5), math.log(0.2 / 0.5)
    assert losses[0] == pytest.approx(-0.15 * (2 * d_a + 2 * d_b) / 4, abs=1e-12)
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)
    assert grads[0] == pytest.approx(grads[1], abs=1e-12)  # d loss / d log π(A), d loss / d log π(B)


def test_behaviour_equal_to_pi_old_is_the_papers_objective_exactly():
    new, old, teacher, resp, action, rules = _random_batch(seed=21)
    plain, m_plain = sapd_loss(new, old, teacher, resp, action, rules)
    same, m_same = sapd_loss(new, old, teacher, resp, action, rules, behaviour_logp_P_G_T=old.clone())
    assert float(same) == float(plain)  # w = exp(0) = 1 exactly: not approximately
    assert m_same["behaviour_weight_mean"] == 1.0 and m_same["behaviour_weight_capped_fraction"] == 0.0
    assert "behaviour_weight_mean" not in m_plain
    inputs = _inputs(new, old, teacher, resp, action, rules)
    assert "behaviour_logp_P_G_T" not in required_inputs(LossConfig())  # passed only for a stale round
    assert float(loss_for(LossConfig(), inputs)[0]) == float(plain)


def test_behaviour_weights_are_truncated_at_the_cap_and_one_on_padding():
    old = torch.log(torch.tensor([[[0.5, 0.5, 0.5]]], dtype=DT))
    mu = torch.log(torch.tensor([[[0.01, 0.5, 0.25]]], dtype=DT))  # π_old/μ = 50, 1, 2
    resp = torch.tensor([[[True, True, False]]])
    assert behaviour_weights(old, mu, resp, cap=5.0).flatten().tolist() == pytest.approx([5.0, 1.0, 1.0])
    assert behaviour_weights(old, mu, torch.ones_like(resp), cap=5.0).flatten()[2] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="behaviour_weight_cap must be ≥ 1"):
        LossConfig(behaviour_weight_cap=0.5)
    _, m = sapd_loss(old.clone(), old, old.clone(), resp, torch.zeros_like(resp), torch.zeros(1, 1, dtype=DT),
                     behaviour_logp_P_G_T=mu)
    assert m["behaviour_weight_capped_fraction"] == pytest.approx(0.5)  # one of the two response tokens
