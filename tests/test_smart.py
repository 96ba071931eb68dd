"""SMART and the Bregman teacher on a 2-layer slice of the real backbone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtbert.data.kinds import Binary, Classification, Regression
from mtbert.model.multitask import MultitaskModel
from mtbert.params import ParamsError, check_heads
from mtbert.params_file import load_params, with_changes
from mtbert.training.build import make_objective
from mtbert.training.losses import task_loss
from mtbert.training.smart import (
    EmaTeacher,
    Perturbation,
    Regularised,
    RngReplay,
    Smart,
    ascent_step,
    project,
    token_norms,
)
from tests.conftest import REPO_ROOT, TASKS

# SMART's l_s of each kind (mtbert/data/kinds.py): the symmetric KLs and the squared error
symmetric_kl_softmax = Classification(5).divergence
symmetric_kl_bernoulli = Binary().divergence
squared_error = Regression(0, 5).divergence

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def params():
    return load_params(REPO_ROOT / "params.yaml")


def smart_params(params, **changes):
    """params.yaml's smart section with SMART on for every task, in adversarial mode, unless `changes` say."""
    every_task = {task: None for task in params.smart.task_lambda}
    return with_changes(params.smart, **{"lambda_": 1.0, "task_lambda": every_task, "mode": "adversarial",
                                                **changes})


def words(model):
    """A Perturbation of the word-embedding lookup of the model's shared encoder."""
    return Perturbation(*model.perturbation_site("sst", "words"))


def make_smart(model, p):
    return Smart(p, lambda task: model.perturbation_site(task, p.perturb), CPU, seed=0)


@pytest.fixture
def model(params, tiny_backbone):
    from mtbert.model.backbone import load_encoder

    torch.manual_seed(0)
    return MultitaskModel(load_encoder(str(tiny_backbone)), TASKS, params.heads).train()


@pytest.fixture(scope="module")
def batches(tiny_tokenizer):
    def pair_batch(encoding):
        first, second = ["a dog runs in the park", "rain"], ["a dog is running", "it is sunny today, not raining"]
        if encoding == "cross":
            encoded = tiny_tokenizer(first, second, padding=True, return_tensors="pt")
            return {**encoded, "labels": torch.tensor([1.0, 0.0])}
        one = tiny_tokenizer(first, padding=True, return_tensors="pt")
        two = tiny_tokenizer(second, padding=True, return_tensors="pt")
        return {"input_ids_1": one["input_ids"], "attention_mask_1": one["attention_mask"],
                "input_ids_2": two["input_ids"], "attention_mask_2": two["attention_mask"],
                "labels": torch.tensor([4.2, 0.4])}

    sst = tiny_tokenizer(["a lovely film", "dull and far too long for what it is"], padding=True, return_tensors="pt")
    return {"sst": {**sst, "labels": torch.tensor([4, 0])}, "qqp": pair_batch("cross"), "sts_bi": pair_batch("bi")}


# --- divergences --------------------------------------------------------------------------------
def test_symmetric_kl_is_non_negative_and_zero_for_identical_inputs():
    torch.manual_seed(0)
    a, b = torch.randn(64, 5) * 3, torch.randn(64, 5) * 3
    assert (symmetric_kl_softmax(a, b) >= 0).all() and symmetric_kl_softmax(a, b).shape == (64,)
    assert torch.equal(symmetric_kl_softmax(a, a), torch.zeros(64))
    x, y = torch.randn(64) * 4, torch.randn(64) * 4
    assert (symmetric_kl_bernoulli(x, y) >= 0).all()
    assert torch.equal(symmetric_kl_bernoulli(x, x), torch.zeros(64))


def test_bernoulli_symmetric_kl_equals_the_two_class_softmax_form():
    torch.manual_seed(1)
    x, y = torch.randn(32) * 3, torch.randn(32) * 3
    as_two_classes = symmetric_kl_softmax(torch.stack([torch.zeros(32), x], -1), torch.stack([torch.zeros(32), y], -1))
    torch.testing.assert_close(symmetric_kl_bernoulli(x, y), as_two_classes, rtol=1e-5, atol=1e-6)


def test_sts_term_is_per_example_and_refuses_broadcasting(model):
    a, b = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.5, 2.0, 1.0])
    assert model.divergence("sts", a, b).shape == (3,)
    torch.testing.assert_close(model.divergence("sts", a, b), torch.tensor([0.25, 0.0, 4.0]))
    with pytest.raises(ValueError, match=r"\(3,\) and \(3, 1\)"):
        squared_error(a, b.unsqueeze(-1))


def test_the_model_takes_each_tasks_divergence_from_its_kind(model):
    torch.manual_seed(2)
    logits_a, logits_b, x, y = torch.randn(8, 5), torch.randn(8, 5), torch.randn(8), torch.randn(8)
    assert torch.equal(model.divergence("sst", logits_a, logits_b), symmetric_kl_softmax(logits_a, logits_b))
    assert torch.equal(model.divergence("qqp", x, y), symmetric_kl_bernoulli(x, y))
    assert torch.equal(model.divergence("sts", x, y), squared_error(x, y))
    assert not torch.equal(model.divergence("qqp", x, y), model.divergence("sts", x, y))


# --- projection -----------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", ["inf", "l2"])
def test_projection_puts_every_token_inside_its_own_ball(norm):
    torch.manual_seed(0)
    delta = torch.randn(4, 7, 16) * torch.logspace(-4, 1, 7).view(1, 7, 1)  # tokens inside and outside
    bound = torch.rand(4, 7, 1) * 0.02 + 0.005  # one radius per token
    projected = project(delta, norm, bound)
    assert (token_norms(projected, norm) <= bound * (1 + 1e-6)).all()
    inside = (token_norms(delta, norm) <= bound).squeeze(-1)
    assert inside.any() and torch.equal(projected[inside], delta[inside])  # already inside: untouched
    outside = ~inside
    torch.testing.assert_close(token_norms(projected, norm)[outside], bound[outside], rtol=1e-5, atol=0)


# --- the perturbation -----------------------------------------------------------------------------
def test_zero_delta_gives_exactly_the_clean_outputs_with_dropout_off(model, batches):
    model.eval()
    clean = model("sst", batches["sst"])
    with words(model).applied(lambda e, m: torch.zeros_like(e)):
        perturbed = model("sst", batches["sst"])
    assert torch.equal(perturbed, clean)


def test_replayed_dropout_gives_exactly_the_clean_outputs_in_training_mode(model, batches):
    replay = RngReplay(CPU)
    clean = model("qqp", batches["qqp"])
    with words(model).applied(lambda e, m: torch.zeros_like(e)), \
            replay.replayed():
        perturbed = model("qqp", batches["qqp"])
    assert torch.equal(perturbed, clean)
    assert not torch.equal(model("qqp", batches["qqp"]), clean)  # dropout is on: a fresh pass differs


def test_delta_is_added_to_word_embeddings_before_position_type_and_layernorm(model, batches):
    model.eval()
    embeddings = model.encoder.embeddings
    ids = batches["qqp"]["input_ids"]
    types = batches["qqp"]["token_type_ids"]
    torch.manual_seed(3)
    delta = torch.randn(*ids.shape, embeddings.word_embeddings.embedding_dim) * 0.1
    with Perturbation(embeddings.word_embeddings, 0).applied(lambda e, m: delta):
        perturbed = embeddings(input_ids=ids, token_type_ids=types)
    positions = embeddings.position_embeddings(torch.arange(ids.shape[1])).unsqueeze(0)
    expected = embeddings.LayerNorm(embeddings.word_embeddings(ids) + delta + positions
                                    + embeddings.token_type_embeddings(types))
    torch.testing.assert_close(perturbed, expected)


def test_bi_encoder_perturbs_each_sentence(model, params, batches):
    heads = {**params.heads, "sts": with_changes(params.heads["sts"], encoding="bi", pooling="mean")}
    check_heads(params.tasks, heads)
    bi_model = MultitaskModel(model.encoder, TASKS, heads).train()
    smart = make_smart(bi_model, smart_params(params))
    batch = batches["sts_bi"]
    replay = RngReplay(CPU)
    loss, sizes = smart.loss(bi_model, "sts", lambda m: m("sts", batch), bi_model("sts", batch), replay)
    assert loss.shape == () and loss.item() > 0 and 0 < sizes["delta_ratio"]
    perturbation = words(bi_model)
    with perturbation.applied(lambda e, m: torch.zeros_like(e)):
        bi_model("sts", batch)
    assert perturbation.deltas[0].shape[0] == 2 * len(batch["labels"])  # both sentences of every pair


@pytest.mark.parametrize("norm", ["inf", "l2"])
def test_ascent_finds_a_worse_perturbation_than_random_noise_of_the_same_size(model, params, batches, norm):
    model.eval()
    p = smart_params(params, norm=norm, radius=0.05)
    smart = make_smart(model, p)
    clean = model("sst", batches["sst"])
    adversarial, _ = smart.loss(model, "sst", lambda m: m("sst", batches["sst"]), clean, RngReplay(CPU))
    random = make_smart(model, with_changes(p, mode="random"))
    with words(model).applied(random._random_delta):
        noise = model.divergence("sst", model("sst", batches["sst"]), clean).mean()
    # So one radius is a much stronger regulariser in adversarial mode than in random mode.
    assert adversarial.item() > 10 * noise.item()


def test_ascent_takes_no_parameter_gradients_but_the_final_term_does(model, params, batches):
    smart = make_smart(model, smart_params(params, steps=2))
    clean = model("sst", batches["sst"])
    loss, _ = smart.loss(model, "sst", lambda m: m("sst", batches["sst"]), clean, RngReplay(CPU))
    assert all(p.grad is None for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())  # unfrozen again after the ascent
    loss.backward()
    assert model.encoder.embeddings.word_embeddings.weight.grad is not None


def test_parameter_gradients_with_lambda_differ_from_lambda_zero(model, params, batches):
    def gradients(lambda_):
        model.zero_grad()
        torch.manual_seed(0)
        objective = make_objective(model, smart_params(params, lambda_=lambda_), CPU, bf16=False, seed=0)
        objective(model, "sst", batches["sst"]).total.backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    plain, again, regularised = gradients(0.0), gradients(0.0), gradients(10.0)
    assert torch.equal(plain, again)
    assert not torch.allclose(plain, regularised)


def test_per_task_lambda_overrides_the_global_one(params):
    p = smart_params(params, lambda_=2.0, task_lambda={**params.smart.task_lambda, "qqp": 0.0, "sts": 5.0})
    assert (p.task_weight("sst"), p.task_weight("qqp"), p.task_weight("sts")) == (2.0, 0.0, 5.0)


def test_smart_off_consumes_no_extra_randomness(model, params, batches):
    """lambda = 0 and mu = 0: the objective is the task loss and the RNG stream is untouched."""
    objective = make_objective(model, smart_params(params, lambda_=0.0, mu=0.0), CPU, bf16=False, seed=0)
    assert not isinstance(objective, Regularised)  # no regulariser built
    torch.manual_seed(0)
    result = objective(model, "sst", batches["sst"])
    torch.manual_seed(0)
    expected = task_loss(model.tasks["sst"], model.head_params["sst"])(model("sst", batches["sst"]), batches["sst"])
    assert torch.equal(result.total, expected) and result.smart_loss is None


# --- the Bregman teacher --------------------------------------------------------------------------
def test_teacher_update_follows_the_formula(model):
    teacher = EmaTeacher(model, 0.9)
    before = [p.detach().clone() for p in teacher.model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    teacher.update(model)
    for old, new, student in zip(before, teacher.model.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * student, rtol=1e-6, atol=1e-7)
    assert all(not p.requires_grad for p in teacher.model.parameters())


def test_teacher_loss_follows_the_students_mode_and_divergence(model, batches):
    teacher = EmaTeacher(model, 0.9)

    def forward(m):
        return m("sst", batches["sst"])

    replay = RngReplay(CPU)  # before the student's pass, as in the objective
    student = forward(model)
    assert teacher.loss(model, "sst", forward, student, replay).item() == 0.0  # same weights, same masks
    assert teacher.model.training
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.eval()
    student = forward(model)
    loss = teacher.loss(model, "sst", forward, student, RngReplay(CPU))
    assert not teacher.model.training  # the student's mode, not a flag
    with torch.no_grad():
        expected = symmetric_kl_softmax(student, forward(teacher.model)).mean()
    torch.testing.assert_close(loss, expected)
    assert loss.item() > 0 and loss.requires_grad  # gradients reach the student only


def test_teacher_equal_to_the_student_gives_zero_bregman_loss_with_dropout_on(model, params, batches):
    objective = make_objective(model, smart_params(params, lambda_=0.0, mu=1.0), CPU, bf16=False, seed=0)
    result = objective(model, "qqp", batches["qqp"])
    assert result.bregman_loss == 0.0


def test_teacher_and_noise_generator_round_trip_through_a_checkpoint(model, params, batches, tmp_path):
    p = smart_params(params, mu=1.0, beta=0.5)
    objective = make_objective(model, p, CPU, bf16=False, seed=0)
    objective(model, "sst", batches["sst"]).total.backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.sub_(0.01 * parameter.grad if parameter.grad is not None else 0.0)
    objective.after_update(model)
    torch.save(objective.state_dict(), tmp_path / "objective.pt")  # as a checkpoint holds it

    restored = make_objective(model, p, CPU, bf16=False, seed=123)
    restored.load_state_dict(torch.load(tmp_path / "objective.pt", weights_only=True))
    saved, loaded = objective.teacher.model.state_dict(), restored.teacher.model.state_dict()
    assert all(torch.equal(saved[name], loaded[name]) for name in saved)
    assert torch.equal(objective.smart.generator.get_state(), restored.smart.generator.get_state())


@pytest.mark.parametrize("dropout", ["same", "off"])
def test_zero_perturbation_gives_zero_smart_loss_under_either_dropout_choice(model, params, batches, dropout):
    objective = make_objective(model, smart_params(params, dropout=dropout, radius=0.0, mu=1.0), CPU,
                          bf16=False, seed=0)
    result = objective(model, "qqp", batches["qqp"])
    assert result.smart_loss == 0.0 and result.bregman_loss == 0.0
    assert result.total.item() > 0 and model.training  # the task loss remains; training mode is restored


# --- the radius: a size a user can read -----------------------------------------------------------
@pytest.mark.parametrize("perturb", ["words", "embeddings"])
@pytest.mark.parametrize("mode", ["random", "adversarial"])
@pytest.mark.parametrize("norm", ["inf", "l2"])
def test_logged_relative_size_is_the_configured_radius(model, params, batches, norm, mode, perturb):
    """random: delta lies on the edge of the ball; adversarial with eta = radius: one step from noise of
    relative size sigma reaches it up to that noise (sigma = 1e-3 here), so within 0.2%."""
    p = smart_params(params, norm=norm, mode=mode, perturb=perturb, radius=0.3, eta=None, sigma=1e-3)
    smart = make_smart(model, p)
    for task in ("sst", "qqp"):
        clean = model(task, batches[task])
        _, sizes = smart.loss(model, task, lambda m, t=task: m(t, batches[t]), clean, RngReplay(CPU))
        assert sizes["delta_ratio"] == pytest.approx(0.3, rel=2e-3 if mode == "adversarial" else 1e-5)
        assert sizes["delta_l2_ratio"] > 0
        assert ("ascended" in sizes) == (mode == "adversarial")


@pytest.mark.parametrize("norm", ["inf", "l2"])
def test_a_token_without_gradient_steps_along_its_starting_noise_to_the_radius(norm):
    """bf16 can round a small delta away, leaving the divergence's gradient exactly 0 for an example:
    its tokens then step along their starting noise, so every real token still ends on the ball's edge."""
    generator = torch.Generator().manual_seed(0)
    start = 1e-3 * torch.randn(2, 3, 4, generator=generator)
    grad = torch.randn(2, 3, 4, generator=generator)
    grad[1] = 0.0  # the second example's output did not move
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool).unsqueeze(-1)  # one padding token
    bound = torch.full((2, 3, 1), 0.5)
    delta, ascended = ascent_step(start, grad, bound, bound, norm, mask)
    assert torch.equal(ascended, torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool).unsqueeze(-1))
    sizes = token_norms(delta, norm)
    assert torch.allclose(sizes[mask], torch.tensor(0.5), rtol=1e-2) and sizes[~mask].eq(0).all()
    # the example without gradient moved along its own noise; the other along its gradient
    assert (F.cosine_similarity(delta[1], start[1], dim=-1) > 0.99).all()
    assert (F.cosine_similarity(delta[0, :2], grad[0, :2], dim=-1) > 0.9).all()


@pytest.mark.parametrize("mode", ["random", "adversarial"])
def test_radius_zero_gives_exactly_the_plain_gradients(model, params, batches, mode):
    def gradients(p, task):
        model.zero_grad()
        torch.manual_seed(0)
        objective = make_objective(model, p, CPU, bf16=False, seed=0)
        objective(model, task, batches[task]).total.backward()
        return torch.cat([q.grad.flatten() for q in model.parameters() if q.grad is not None])

    for task in ("sst", "qqp"):
        plain = gradients(smart_params(params, lambda_=0.0), task)
        zero_radius = gradients(smart_params(params, lambda_=10.0, radius=0.0, mode=mode), task)
        assert torch.equal(plain, zero_radius)


def count_encoder_passes(model) -> list[int]:
    calls = [0]
    model.encoder.register_forward_hook(lambda *args: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize(("mode", "steps", "passes"), [("random", 1, 2), ("adversarial", 1, 3), ("adversarial", 2, 4)])
def test_random_mode_runs_no_ascent_pass(model, params, batches, mode, steps, passes):
    """Clean pass + K ascent passes + the adversarial pass; random mode has no ascent pass."""
    objective = make_objective(model, smart_params(params, mode=mode, steps=steps, radius=0.1), CPU, bf16=False, seed=0)
    calls = count_encoder_passes(model)
    objective(model, "sst", batches["sst"]).total.backward()
    assert calls[0] == passes


@pytest.mark.parametrize("perturb", ["words", "embeddings"])
def test_the_chosen_tensor_is_perturbed_once(model, batches, perturb):
    """delta reaches the encoder's input once: added to the chosen site's output and to nothing else."""
    model.eval()
    embeddings = model.encoder.embeddings
    batch = batches["qqp"]
    ids, types = batch["input_ids"], batch["token_type_ids"]
    torch.manual_seed(3)
    delta = torch.randn(*ids.shape, embeddings.word_embeddings.embedding_dim) * 0.1
    site, pad = model.perturbation_site("qqp", perturb)
    seen = []
    model.encoder.encoder.register_forward_pre_hook(lambda module, args, kwargs: seen.append(args[0]),
                                                    with_kwargs=True)
    perturbation = Perturbation(site, pad)
    with perturbation.applied(lambda e, m: delta * m):
        model("qqp", batch)
    clean_words = embeddings.word_embeddings(ids)
    positions = embeddings.position_embeddings(torch.arange(ids.shape[1])).unsqueeze(0)
    others = positions + embeddings.token_type_embeddings(types)
    mask = perturbation.token_masks[0]
    if perturb == "embeddings":
        expected = embeddings.LayerNorm(clean_words + others) + delta * mask  # after LayerNorm, added once
    else:
        expected = embeddings.LayerNorm(clean_words + delta * mask + others)
    assert len(seen) == 1 and len(perturbation.deltas) == 1
    torch.testing.assert_close(seen[0], expected)


@pytest.mark.parametrize("changes", [{"eta": 0.01, "radius": 0.1}, {"eta": 0.02, "steps": 2, "radius": 0.05}])
def test_an_ascent_that_never_reaches_the_radius_is_refused(params, changes):
    with pytest.raises(ParamsError, match="never reach the radius"):
        smart_params(params, **changes)
