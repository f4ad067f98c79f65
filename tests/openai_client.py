"""The official `openai` Python client drives `mamba3 serve` unchanged.

Run by scripts/openai-client-test against a server on a tiny model (the siso-mlp-norm
fixture's weights with the byte-level test tokenizer and its chat template), started with
--api-key sk-ci --model-name tiny --max-tokens-limit 64.
"""
import base64
import struct
import sys
import traceback

import openai

BASE = sys.argv[1]
# The model's width: embeddings have this many numbers.
D_MODEL = int(sys.argv[2]) if len(sys.argv) > 2 else 96
MODEL = "tiny"
client = openai.OpenAI(base_url=BASE, api_key="sk-ci", max_retries=0, timeout=60)
results = []


def test(fn):
    try:
        fn()
        results.append((fn.__name__, None))
        print(f"ok   {fn.__name__}")
    except Exception:  # noqa: BLE001 - report every failure and go on
        results.append((fn.__name__, traceback.format_exc()))
        print(f"FAIL {fn.__name__}\n{traceback.format_exc()}")
    return fn


@test
def models_list():
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL], ids
    assert client.models.retrieve(MODEL).id == MODEL


@test
def completion_plain_and_streamed_agree():
    r = client.completions.create(model=MODEL, prompt="The state of", max_tokens=12, temperature=0)
    text = r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens == 1 + len("The state of".encode()) - 2, r.usage
    chunks = list(client.completions.create(model=MODEL, prompt="The state of", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text, (streamed, text)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


@test
def completion_token_id_prompt():
    r = client.completions.create(model=MODEL, prompt=[264, 40, 41, 42], max_tokens=5, temperature=0)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 5


@test
def same_seed_same_text():
    a = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    b = client.completions.create(model=MODEL, prompt="abc", max_tokens=20, temperature=1.0, top_p=0.9, seed=7)
    assert a.choices[0].text == b.choices[0].text


@test
def chat_plain_and_streamed_agree():
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    text = r.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join((c.choices[0].delta.content or "") for c in chunks if c.choices)
    assert streamed == text, (streamed, text)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@test
def logprobs_of_both_routes():
    # Completions: the legacy shape, `logprobs` alternatives a token, plain and streamed alike.
    r = client.completions.create(model=MODEL, prompt="The state of", max_tokens=6, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the best, its logprob the largest of its alternatives
    assert all(abs(v - max(top.values())) < 1e-6 for v, top in zip(lp.token_logprobs, lp.top_logprobs))
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    chunks = list(client.completions.create(model=MODEL, prompt="The state of", max_tokens=6, temperature=0,
                                            logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs, (streamed, lp.token_logprobs)
    # Chat: `logprobs: true`, `top_logprobs: n`.
    msgs = [{"role": "user", "content": "Hello!"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert bytes(t.bytes).decode() == t.token and abs(t.logprob - t.top_logprobs[0].logprob) < 1e-6
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert streamed == [t.logprob for t in content], (streamed, content)
    try:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, logprobs=True, top_logprobs=21)
        raise AssertionError("top_logprobs 21 accepted")
    except openai.BadRequestError as e:
        assert "top_logprobs" in str(e)


@test
def embeddings_base64_and_float():
    r = client.embeddings.create(model=MODEL, input=["first text", "second"])  # the client asks for base64
    assert len(r.data) == 2 and len(r.data[0].embedding) == D_MODEL, len(r.data[0].embedding)
    f = client.embeddings.create(model=MODEL, input=["first text", "second"], encoding_format="float")
    for a, b in zip(r.data, f.data):
        assert max(abs(x - y) for x, y in zip(a.embedding, b.embedding)) < 1e-6
    assert r.data[0].embedding != r.data[1].embedding
    assert r.usage.prompt_tokens == f.usage.prompt_tokens > 0


@test
def errors_are_openai_errors():
    try:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert "does not exist" in str(e)
    try:
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
        raise AssertionError("max_tokens over the limit accepted")
    except openai.BadRequestError as e:
        assert "at most 64" in str(e)
    bad = openai.OpenAI(base_url=BASE, api_key="wrong", max_retries=0)
    try:
        bad.models.list()
        raise AssertionError("wrong key accepted")
    except openai.AuthenticationError:
        pass


failed = [n for n, e in results if e]
print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
sys.exit(1 if failed else 0)
