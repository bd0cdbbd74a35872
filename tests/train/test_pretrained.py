"""Local Hugging Face checkpoints behind the task's tokens, and the training job on them (--model,
--dtype bfloat16, --grad-checkpointing)."""

import pytest
import torch
from _flags import SHORT

from ppo_objectives import train as T
from ppo_objectives.llm.env import TokenLMEnv
from ppo_objectives.llm.hf import HFCausalLMAdapter
from ppo_objectives.llm.models import TinyCausalLM, TinyLMConfig
from ppo_objectives.llm.policy import NextTokenLogits
from ppo_objectives.llm.readouts import make_actor_critic
from ppo_objectives.llm.token_map import TokenMappedLM
from ppo_objectives.pretrained import main as export_main
from ppo_objectives.train import pretrained as PT
from ppo_objectives.train.digit import DigitTask

pytest.importorskip("transformers")

TASK = DigitTask("reverse", 3)
TINY = dict(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(arch, with_tokenizer) -> a tiny checkpoint directory, written once per module."""
    made = {}

    def get(arch="llama", with_tokenizer=True):
        key = (arch, with_tokenizer)
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}_{'tok' if with_tokenizer else 'notok'}")
            made[key] = PT.write_tiny_checkpoint(out, arch, task=TASK, with_tokenizer=with_tokenizer,
                                                 tie_word_embeddings=False, **TINY)  # an untied head: the harder case
        return made[key]

    return get


def _ids(B=3, T_=8, V=16, seed=0):
    return torch.randint(V, (B, T_), generator=torch.Generator().manual_seed(seed))


# --------------------------------------------------------------------------- #
# Writing and loading
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("arch, cls", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_a_written_checkpoint_loads_back_through_from_pretrained_with_the_same_weights(ckpt, arch, cls):
    from transformers import AutoModelForCausalLM

    path = ckpt(arch)
    lm = PT.load_policy_model(path, TASK)
    assert type(lm.model.hf_model).__name__ == cls
    assert isinstance(lm.model, HFCausalLMAdapter) and lm.training
    config = lm.model.hf_model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (32, 1, 2)
    assert lm.model.vocab_size == 32 and lm.vocab_size == TASK.vocab_size  # 23 tokenizer tokens, padded to 32
    direct = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True).state_dict()
    mine = lm.model.hf_model.state_dict()
    assert mine.keys() == direct.keys() and all(torch.equal(mine[k], direct[k]) for k in direct)


def test_the_same_seed_writes_the_same_weights_and_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(5)
    state = torch.get_rng_state()
    a = PT.write_tiny_checkpoint(tmp_path / "a", "llama", seed=3, with_tokenizer=False, **TINY)
    assert torch.equal(torch.get_rng_state(), state)
    b = PT.write_tiny_checkpoint(tmp_path / "b", "llama", seed=3, with_tokenizer=False, **TINY)
    sa, sb = (PT.load_policy_model(p, TASK, token_map="identity").state_dict() for p in (a, b))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_write_tiny_checkpoint_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError, match="arch='gpt2' is unknown; choose one of"):
        PT.write_tiny_checkpoint(tmp_path, "gpt2")
    with pytest.raises(ValueError, match="hidden_size=30 must be divisible by num_heads=4"):
        PT.write_tiny_checkpoint(tmp_path, "llama", hidden_size=30)
    with pytest.raises(ValueError, match="num_layers"):
        PT.write_tiny_checkpoint(tmp_path, "llama", num_layers=0)


def test_the_cli_writes_a_checkpoint(tmp_path, capsys):
    assert export_main(["--arch", "qwen2", "--out", str(tmp_path), "--hidden-size", "32", "--layers", "1"]) == 0
    assert (tmp_path / "config.json").is_file() and (tmp_path / "tokenizer.json").is_file()
    assert "--model" in capsys.readouterr().out


def test_a_missing_directory_or_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        PT.load_policy_model(tmp_path / "nowhere", TASK)
    with pytest.raises(FileNotFoundError, match="has no config.json, so it is not a Hugging Face checkpoint"):
        PT.load_policy_model(tmp_path, TASK)


# --------------------------------------------------------------------------- #
# The token mapping
# --------------------------------------------------------------------------- #


def test_task_tokens_go_through_the_tokenizer(ckpt):
    tok = PT.load_tokenizer(ckpt("llama"))
    ids = PT.task_token_ids(TASK, tok, 32)
    assert tok.convert_ids_to_tokens(ids.tolist()) == list(TASK.VOCAB)  # each task token is its own string
    assert ids.unique().numel() == 16 and not torch.equal(ids, torch.arange(16))  # not the task's ids
    assert {"<pad>", "<eos>", "<unk>"} <= set(tok.get_vocab()) and len(tok) > TASK.vocab_size


def test_without_a_tokenizer_the_mapping_is_the_identity(ckpt):
    assert PT.load_tokenizer(ckpt("qwen2", with_tokenizer=False)) is None
    with pytest.raises(ValueError, match=r"--model .* has no tokenizer \(tokenizer\.json / tokenizer_config\.json\), so "
                                         r"the task's tokens cannot be found in the model's vocabulary.* pass --token-map "
                                         r"identity"):
        PT.load_policy_model(ckpt("qwen2", with_tokenizer=False), TASK)
    lm = PT.load_policy_model(ckpt("qwen2", with_tokenizer=False), TASK, token_map="identity")
    assert torch.equal(lm.token_ids, torch.arange(16)) and lm.model.vocab_size == 32
    with pytest.raises(ValueError, match="the model's vocabulary has 10 tokens but the task has 16"):
        PT.task_token_ids(TASK, None, 10)


class _Vocab:  # a stand-in tokenizer: get_vocab and convert_tokens_to_ids over a dict
    def __init__(self, strings):
        self.vocab = {s: i for i, s in enumerate(strings)}

    def get_vocab(self):
        return dict(self.vocab)

    def convert_tokens_to_ids(self, tokens):
        return [self.vocab[t] for t in tokens]


def test_task_tokens_unknown_to_the_tokenizer_are_named():
    tok = _Vocab([c for c in TASK.VOCAB if c not in "+="])
    with pytest.raises(KeyError, match=r"the task tokens \['\+', '='\] are not in the tokenizer's vocabulary"):
        PT.task_token_ids(TASK, tok, 32)


def test_a_token_map_outside_the_model_or_with_repeats_is_refused():
    tok = _Vocab([f"<{i}>" for i in range(30)] + list(TASK.VOCAB))  # task tokens at ids 30..45
    with pytest.raises(ValueError, match="holds model id 45, outside the model's vocabulary"):
        PT.task_token_ids(TASK, tok, 32)
    inner = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=8))
    with pytest.raises(ValueError, match="maps two task tokens to one model token"):
        TokenMappedLM(inner, torch.tensor([1, 2, 1]))
    with pytest.raises(ValueError, match=r"token_ids must be a non-empty 1-D integer tensor \[V_task\]"):
        TokenMappedLM(inner, torch.tensor([[1, 2]]))
    with pytest.raises(TypeError, match="model must be a causal LM with our interface"):
        TokenMappedLM(torch.nn.Linear(2, 2), torch.tensor([1]))
    with pytest.raises(TypeError, match="task must have a VOCAB"):
        PT.task_token_ids(object(), None, 32)


def test_input_ids_outside_the_task_vocabulary_are_refused():
    lm = TokenMappedLM(TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=8)), torch.arange(4))
    with pytest.raises(ValueError, match=r"input_ids holds task token id 5, outside the task's vocabulary \[0, 4\)"):
        lm(torch.tensor([[1, 5]]))
    with pytest.raises(TypeError, match="input_ids must hold integer task token ids"):
        lm(torch.tensor([[1.0, 2.0]]))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mapped_logits_are_the_models_logits_at_the_task_tokens_columns(ckpt, arch):
    lm = PT.load_policy_model(ckpt(arch), TASK)
    ids = _ids()
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[0, :3] = False  # a left-padded row
    out = lm(ids, mask)
    full = lm.model(lm.token_ids[ids], mask)  # the model in its own vocabulary: [B, T, V]
    assert out.logits.shape == (3, 8, 16) and out.logits.dtype == torch.float32
    torch.testing.assert_close(out.logits, full.logits[..., lm.token_ids], atol=1e-6, rtol=0)
    torch.testing.assert_close(out.hidden, full.hidden, atol=0, rtol=0)
    assert lm(ids, mask, compute_logits=False).logits is None
    torch.testing.assert_close(lm.lm_head(out.hidden), out.logits, atol=0, rtol=0)


def test_the_head_is_the_inner_heads_rows_and_is_in_the_state_dict_once(ckpt):
    lm = PT.load_policy_model(ckpt("llama"), TASK)
    weight, bias = lm.lm_head_parameters()
    head = lm.model.lm_head.weight
    assert weight.shape == (16, 32) and bias is None and torch.equal(weight, head[lm.token_ids])
    lm(_ids()).logits.sum().backward()
    rows = head.grad.abs().sum(-1) > 0  # only the task tokens' rows of the head get a gradient
    assert rows.nonzero().squeeze(-1).tolist() == sorted(lm.token_ids.tolist())
    assert sorted(lm.state_dict()) == sorted("model." + k for k in lm.model.state_dict())


def test_the_hidden_state_read_out_through_the_restricted_head_equals_the_logits_read_out(ckpt):
    from ppo_objectives.llm.readouts import ResponseLogProbs, lm_head_parameters

    lm = PT.load_policy_model(ckpt("qwen2"), TASK)
    assert lm_head_parameters(lm)[0].shape == (16, 32)  # the read-outs find the task's rows
    ids = _ids(B=4, T_=8)
    mask = torch.ones_like(ids, dtype=torch.bool)
    P = TASK.prompt_len
    (a, ha), (b, hb) = (ResponseLogProbs(lm, P, from_hidden=f)(ids, mask) for f in (False, True))
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hb, ha, atol=1e-5, rtol=1e-5)


def test_autocast_dtype_and_the_kv_cache_are_the_inner_models():
    inner = TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=10, block_size=8))
    lm = TokenMappedLM(inner, torch.tensor([3, 1, 4, 5]))
    lm.autocast_dtype = torch.bfloat16
    assert inner.autocast_dtype is torch.bfloat16 and lm.autocast_dtype is torch.bfloat16
    assert lm.supports_kv_cache and lm.new_cache(2, 8).k.dtype == torch.bfloat16


def test_a_model_without_a_cache_says_so():
    class NoCache(torch.nn.Module):  # our LM interface, no supports_kv_cache
        vocab_size, hidden_size = 8, 4
        lm_head = torch.nn.Linear(4, 8, bias=False)

    with pytest.raises(ValueError, match="has no KV cache"):
        TokenMappedLM(NoCache(), torch.arange(3)).new_cache(1, 4)


def _cached_equals_full(lm):
    """Prefill 5 columns into the cache, then 3 one-token steps: the logits of the full forward."""
    ids = _ids(B=2, T_=8, V=lm.vocab_size, seed=1)
    lm.eval()
    with torch.no_grad():
        full = lm(ids).logits
        cache = lm.new_cache(2, 8)
        parts = [lm(ids[:, :5], cache=cache, cache_slots=0, position_ids=torch.arange(5).expand(2, 5)).logits]
        for t in range(5, 8):
            parts.append(lm(ids[:, t : t + 1], cache=cache, cache_slots=t, position_ids=torch.full((2, 1), t)).logits)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_the_kv_cache_path_equals_the_full_forward(ckpt):
    torch.manual_seed(0)
    _cached_equals_full(TokenMappedLM(TinyCausalLM(TinyLMConfig.preset("pico", vocab_size=20, block_size=8)),
                                         torch.tensor([7, 3, 11, 0, 19, 2])))
    for arch in ("llama", "qwen2"):
        lm = PT.load_policy_model(ckpt(arch), TASK)
        if lm.supports_kv_cache:  # the Hugging Face adapter's own cache, where it has one
            _cached_equals_full(lm)


def test_the_env_policy_on_a_mapped_model_matches_its_full_forward(ckpt):
    lm = PT.load_policy_model(ckpt("llama"), TASK).eval()
    env = TokenLMEnv.from_task(TASK, num_envs=4, seed=0)
    td = env.reset()
    cached, plain = NextTokenLogits(lm), NextTokenLogits(lm, use_kv_cache=False)
    with torch.no_grad():
        for _ in range(3):
            a = cached(td["tokens"], td["attention_mask"], td["position"])
            b = plain(td["tokens"], td["attention_mask"], td["position"])
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
            td["action"] = a.argmax(-1)
            td = env.step(td)["next"]


# --------------------------------------------------------------------------- #
# Gradient checkpointing and mixed precision
# --------------------------------------------------------------------------- #


def _grads(lm, ids, mask):
    lm.zero_grad(set_to_none=True)
    out = lm(ids, mask)
    (out.logits.logsumexp(-1).sum() + out.hidden.square().mean()).backward()
    return {n: p.grad.clone() for n, p in lm.named_parameters()}


def test_gradient_checkpointing_gives_the_same_gradients(ckpt):
    path = ckpt("qwen2")
    plain, checkpointed = PT.load_policy_model(path, TASK), PT.load_policy_model(path, TASK, grad_checkpointing=True)
    assert checkpointed.model.hf_model.is_activation_checkpointing
    assert not plain.model.hf_model.is_activation_checkpointing
    ids = _ids()
    mask = torch.ones_like(ids, dtype=torch.bool)
    mask[1, :2] = False
    a, b = _grads(plain, ids, mask), _grads(checkpointed, ids, mask)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=1e-5, msg=name)


def _minibatch_terms(lm, batch, P):
    """log-probs and loss terms of one TokenPPOLoss minibatch for the actor / critic on ``lm``."""
    from ppo_objectives.loss import TokenPPOLoss

    torch.manual_seed(0)
    ac = make_actor_critic(lm, P)
    torch.nn.init.normal_(ac.critic_head.weight, std=0.2)  # a value head that reads the trunk
    loss = TokenPPOLoss(ac.actor, ac.critic, kl_to_ref_coeff=0.02, entropy_coeff=0.01, entropy_bonus=True,
                        functional=False)
    td = batch.clone()
    out = loss(td)
    logp = ac.actor(batch.clone())["log_prob"]
    return logp, {k: v.detach() for k, v in out.items() if k.startswith("loss_")}


def test_bfloat16_autocast_loss_terms_and_log_probs_are_within_a_measured_tolerance(ckpt):
    # One minibatch (8 rows, 4 response tokens) of the hidden-64 two-layer Llama read in float32
    # and under bf16 autocast (float32 weights). Measured on this checkpoint: the log-probs differ
    # by at most 1.7e-3 nats, the loss terms by at most 1.7e-3 relative (loss_critic; 6e-4 for
    # loss_objective); the bounds are about 6x that.
    from tensordict import TensorDict

    path = PT.write_tiny_checkpoint(ckpt("llama").parent / "wide", "llama", task=TASK,
                                    tie_word_embeddings=False)  # hidden 64, 2 layers, untied (as measured)
    P, R, B = TASK.prompt_len, TASK.answer_len, 8
    gen = torch.Generator().manual_seed(0)
    resp = torch.randint(2, 12, (B, R), generator=gen)
    ids = torch.cat([TASK.sample_prompts(B, gen), resp], 1)
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[0, 2:] = False
    batch = TensorDict(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool), mask=mask,
                       sample_log_prob=-torch.rand(B, R, generator=gen) - 2.0, ref_log_prob=-torch.rand(B, R) - 2.0,
                       advantage=torch.randn(B, R, generator=gen), value_target=torch.randn(B, R, generator=gen),
                       state_value=torch.randn(B, R, generator=gen) * 0.1, batch_size=[B])  # fmt: skip
    logp32, terms32 = _minibatch_terms(PT.load_policy_model(path, TASK), batch, P)
    logp16, terms16 = _minibatch_terms(PT.load_policy_model(path, TASK, autocast_dtype=torch.bfloat16), batch, P)
    assert logp16.dtype == torch.float32
    torch.testing.assert_close(logp16[mask], logp32[mask], atol=1e-2, rtol=0)
    assert not torch.equal(logp16[mask], logp32[mask])  # autocast did change the arithmetic
    for k in terms32:
        torch.testing.assert_close(terms16[k], terms32[k], atol=1e-5, rtol=1e-2, msg=k)


# --------------------------------------------------------------------------- #
# The training job: --model, --resume, --dtype, --grad-checkpointing
# --------------------------------------------------------------------------- #


def _job(path, out, *extra):
    T.main(["--model", str(path), "--out", str(out), *SHORT, *extra])
    return T.read_metrics(out / "metrics.csv")


_NOT_TIMING = ("reward", "exact", "kl_ref", "loss_objective", "loss_critic", "kl_approx", "entropy", "grad_norm")


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_job_trains_a_checkpoint_and_resumes_exactly(ckpt, tmp_path, arch):
    path = ckpt(arch)
    full = _job(path, tmp_path / "full", "--iterations", "3")
    _job(path, tmp_path / "split", "--iterations", "2")
    state = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    assert state["iteration"] == 2 and state["config"]["model"] == str(path)
    for name in ("actor_model", "critic_model", "reference"):  # the token-mapped networks' state dicts
        assert all(k.startswith("model.hf_model.") for k in state[name]), name
    resumed = _job(path, tmp_path / "split", "--iterations", "3", "--resume")
    assert [r["iteration"] for r in resumed] == [1.0, 2.0, 3.0]
    for key in _NOT_TIMING:
        assert [r[key] for r in resumed] == pytest.approx([r[key] for r in full], rel=1e-5, abs=1e-7), key
    with pytest.raises(SystemExit):  # another --model: refused before anything is built, as an error line
        T.main(["--out", str(tmp_path / "split"), "--iterations", "4", "--resume", *SHORT])
    with pytest.raises(ValueError, match="was written by a run with --model .* but this run has --model ''"):
        T.train(T.TrainConfig(**{**vars(T.build_parser().parse_args(["--out", str(tmp_path / "split"),
                                 "--iterations", "4", "--resume", *SHORT])), "allow_change": "model"}))


@pytest.mark.slow
def test_the_job_in_bfloat16_keeps_float32_master_weights_and_a_bf16_reference(ckpt, tmp_path):
    rows = _job(ckpt("llama"), tmp_path, "--iterations", "2", "--dtype", "bfloat16", "--grad-checkpointing")
    assert len(rows) == 2 and all(torch.isfinite(torch.tensor(r["loss_objective"])) for r in rows)
    assert rows[-1]["updates"] >= 1
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert {v.dtype for v in state["actor_model"].values()} == {torch.float32}
    assert {v.dtype for v in state["critic_model"].values()} == {torch.float32}
    assert {v.dtype for v in state["reference"].values()} == {torch.bfloat16}
    moments = [s["exp_avg"] for s in state["actor_opt"]["state"].values()]
    assert moments and {m.dtype for m in moments} == {torch.float32}


@pytest.mark.slow
def test_the_preset_job_runs_in_bfloat16_too(tmp_path):
    T.main(["--preset", "pico", "--iterations", "1", "--dtype", "bfloat16", "--out", str(tmp_path), *SHORT])
    state = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert {v.dtype for v in state["reference"].values()} == {torch.bfloat16}


def test_job_flags_are_checked_before_the_run(tmp_path, capsys, cli_error):
    assert "no such directory" in cli_error(["--model", str(tmp_path / "nowhere"), "--iterations", "1", "--out",
                                             str(tmp_path / "o"), *SHORT])
    assert "has no config.json" in cli_error(["--model", str(tmp_path), "--iterations", "1", "--out",
                                              str(tmp_path / "o"), *SHORT])
    with pytest.raises(ValueError, match="--grad-checkpointing needs --model DIR"):
        T.TrainConfig(grad_checkpointing=True)
    with pytest.raises(ValueError, match=r"TrainConfig dtype='float16' must be one of \('float32', 'bfloat16'\)"):
        T.TrainConfig(dtype="float16")
    with pytest.raises(SystemExit, match="2"):
        T.build_parser().parse_args(["--dtype", "float16"])
    assert "invalid choice: 'float16'" in capsys.readouterr().err


def test_a_tied_checkpoint_shares_its_embedding_with_the_head(tmp_path):
    path = PT.write_tiny_checkpoint(tmp_path, "llama", tie_word_embeddings=True, **TINY)
    hf = PT.load_policy_model(path, TASK).model.hf_model
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight


def test_a_tiny_checkpoint_ties_its_embedding_by_default_and_the_cli_can_untie_it(tmp_path):
    # Tied, as TinyCausalLM: the job learned the digit task slower from an untied tiny checkpoint
    # (reverse, seed 0, 300 iterations: last-10 reward 0.55 untied, 0.78 tied; write_tiny_checkpoint)
    hf = PT.load_policy_model(PT.write_tiny_checkpoint(tmp_path / "api", "llama", **TINY), TASK).model.hf_model
    assert hf.config.tie_word_embeddings and hf.lm_head.weight is hf.model.embed_tokens.weight
    small = ["--hidden-size", "32", "--layers", "1"]
    assert export_main(["--out", str(tmp_path / "cli"), *small]) == 0
    assert export_main(["--out", str(tmp_path / "cli_tied"), "--tie-embeddings", *small]) == 0
    assert export_main(["--out", str(tmp_path / "cli_untied"), "--no-tie-embeddings", *small]) == 0
    tied = {d: PT.load_policy_model(tmp_path / d, TASK).model.hf_model for d in ("cli", "cli_tied", "cli_untied")}
    assert tied["cli"].lm_head.weight is tied["cli"].model.embed_tokens.weight
    assert tied["cli_tied"].lm_head.weight is tied["cli_tied"].model.embed_tokens.weight
    assert not tied["cli_untied"].config.tie_word_embeddings
    assert tied["cli_untied"].lm_head.weight is not tied["cli_untied"].model.embed_tokens.weight


def test_untied_lm_head_tells_which_critic_trunks_have_a_head_that_takes_no_gradient(ckpt, tmp_path):
    from ppo_objectives.train.distributed import untied_lm_head

    tied = PT.write_tiny_checkpoint(tmp_path, "llama", task=TASK, **TINY)
    assert not untied_lm_head(PT.load_policy_model(tied, TASK))
    assert untied_lm_head(PT.load_policy_model(ckpt("llama"), TASK))  # the fixture's head is untied
    config = TinyLMConfig.preset("pico", vocab_size=16, block_size=16)
    assert not untied_lm_head(TinyCausalLM(config))
    assert untied_lm_head(TinyCausalLM(TinyLMConfig(**{**config.__dict__, "tie_weights": False})))
    assert not untied_lm_head(torch.nn.Linear(2, 2))  # no head at all


@pytest.mark.slow
def test_torchrun_ddp_trains_an_untied_checkpoint(ckpt, tmp_path, torchrun):
    # the critic trunk's untied LM head takes no gradient: DDP must look for unused parameters (it stopped
    # at the second backward without), and only there
    proc, _ = torchrun(tmp_path / "run", 2, "--model", str(ckpt("llama")), "--no-plot")
    assert "parameters identical on all 2 ranks" in proc.stderr
    assert [r["iteration"] for r in T.read_metrics(tmp_path / "run" / "metrics.csv")] == [1.0, 2.0]
