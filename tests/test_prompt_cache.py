"""The prompt cache: RAM and SSD tiers, exact after hits, bounded, and never hurt by a bad folder.

Exactness: a conversation that grows turn by turn, each turn starting from the cache, must decode
token for token as mlx_lm decodes the whole prompt, for an attention target (qwen3), a sliding-window
one (gemma3_text) and a Gated DeltaNet hybrid (qwen3_5), from RAM and from files after a restart.
Faults: a writer killed mid-write, truncated, corrupted and foreign files, a full disk (a 16 KiB
tmpfs when mount works, else skipped; plus a simulated ENOSPC that always runs), an unwritable
folder (a path under a file; a read-only bind mount when mount works): every request still
answered exactly, nothing wrong ever loaded.
"""

import gc
import http.client
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from test_hybrid import PROMPT, build, make_drafter
from test_server_process import Serve
from tiny import NO_EOS

import dflash_mlx
from dflash_mlx import DFlashModel, Engine, PromptCache
from dflash_mlx.cache import disk as disk_module
from dflash_mlx.cache.index import BLOCK, PrefixIndex
from dflash_mlx.cache.ragged import RaggedKVCache
from dflash_mlx.target import Target

LOG = "dflash_mlx.prompt_cache"
N = 10  # tokens per turn
EXTRA = [[3, 4, 5], [7, 8], [9, 11, 13, 15]]  # what the "user" adds after each reply


def reference(model, prompt, n=N):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n)]


def run(pair, prompts, cache, n=N, **kwargs):
    """Every prompt through one engine (batched when several): their tokens and cached counts."""
    engine = Engine(pair, block_size=4, prefill_step_size=8, prompt_cache=cache, max_rows=len(prompts), **kwargs)
    uids = [engine.add(p, max_tokens=n) for p in prompts]
    cached = [engine.cached_tokens(u) for u in uids]
    out = {u: [] for u in uids}
    while not engine.idle:
        for e in engine.step():
            out[e.uid].append(e.token)
    return [out[u] for u in uids], cached


@pytest.fixture(scope="module", params=["qwen3", "gemma3_text", "qwen3_5"])
def family(request, tiny_pair):
    if request.param == "qwen3":
        pair, _ = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    else:
        model = build(request.param)
        pair = DFlashModel(Target(model, [0, 2]), make_drafter(model))
    return request.param, pair


def conversation(pair, cache, turns=3, restart=None):
    """A chat growing by a reply and a user message per turn; checks every turn against mlx_lm.
    ``restart``: called between turns, returns the cache the next turn uses. Returns cached counts."""
    prompt, counts = list(PROMPT), []
    for turn in range(turns):
        (out,), (cached,) = run(pair, [prompt], cache)
        assert out == reference(pair.target.model, prompt), f"turn {turn}"
        counts.append(cached)
        prompt = prompt + out + EXTRA[turn]
        if restart is not None:
            cache = restart(cache)
    return counts


def test_ram_hits_are_exact(family):
    name, pair = family
    cache = PromptCache()
    counts = conversation(pair, cache)
    assert counts[0] == 0 and cache.ram_hits == 2 and cache.misses == 1
    # Each turn extends the last: the whole previous exchange is cached (the last reply token was
    # never in the caches; a recurrent state serves whole entries only, here the reply's).
    assert counts[1] == len(PROMPT) + N - 1
    assert counts[2] == counts[1] + 1 + len(EXTRA[0]) + N - 1


def test_a_reply_rendered_differently_still_finds_its_prompt(family, tmp_path):
    """The next turn extends the prompt, not the reply as generated (a chat template may render it
    otherwise): an attention target cuts the entry to the prompt and what matches after; a
    recurrent state serves whole entries only, so its prompt's own snapshot serves."""
    name, pair = family
    cache = PromptCache(directory=str(tmp_path))
    (out,), _ = run(pair, [PROMPT], cache)
    prompt = PROMPT + out[:2] + [(out[2] + 1) % 60] + [3, 4]
    (again,), (cached,) = run(pair, [prompt], cache)
    assert again == reference(pair.target.model, prompt)
    assert cached == (len(PROMPT) if name == "qwen3_5" else len(PROMPT) + 2)
    assert cache.flush(60)
    # The same prompt again, from the files: a recurrent state after the whole prompt cannot serve
    # it (its last token must be prefilled again), so the previous boundary does.
    (again,), (cached,) = run(pair, [prompt], PromptCache(directory=str(tmp_path)))
    assert cached == (len(PROMPT) if name == "qwen3_5" else len(prompt) - 1)
    assert again == reference(pair.target.model, prompt)


def test_ssd_hits_after_a_restart_are_exact(family, tmp_path):
    name, pair = family

    def restart(cache):
        assert cache.flush(60)
        cache.close()
        return PromptCache(directory=str(tmp_path))  # a new process would find the same files

    caches = []
    counts = conversation(pair, PromptCache(directory=str(tmp_path)),
                          restart=lambda c: caches.append(restart(c)) or caches[-1])
    assert counts[1] == len(PROMPT) + N - 1 and counts[2] > counts[1]
    assert [c.disk_hits for c in caches[:2]] == [1, 1]


def test_files_hold_exactly_what_was_saved(family, tmp_path):
    """Every array and count of an entry comes back from its file bit for bit."""
    name, pair = family
    cache = PromptCache(directory=str(tmp_path))
    run(pair, [PROMPT], cache, draft_window=(4, 8))
    cache.flush(60)
    saved = list(cache.entries.values())[-1]
    fresh = PromptCache(directory=str(tmp_path))
    fresh.bind(pair, (4, 8))
    key = next(k for k, t in fresh.disk.index.tokens.items() if t == saved.tokens)
    tokens, target, draft = fresh.disk.load(key)
    assert tokens == saved.tokens
    for mine, theirs in zip(saved.cache + saved.draft_cache, target + draft):
        assert type(mine) is type(theirs)
        if isinstance(mine, RaggedKVCache):
            assert mine.lengths == theirs.lengths and getattr(mine, "dropped", 0) == getattr(theirs, "dropped", 0)
            arrays = [(mine.keys, theirs.keys), (mine.values, theirs.values)] if mine.keys is not None else []
        else:
            arrays = list(zip(mine.cache, theirs.cache))
        for a, b in arrays:
            assert a.dtype == b.dtype and mx.array_equal(a, b).item()
    assert all(c.dropped[0] for c in draft)  # the drafter window dropped rows: their positions survive


def test_batched_requests_hit_and_stay_exact(tiny_pair, tmp_path):
    pair, _ = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    cache = PromptCache(directory=str(tmp_path))
    (first,), _ = run(pair, [PROMPT], cache)
    base = PROMPT + first
    prompts = [base + [3, 4], base[:25] + [9], base + [5] * 20]
    outs, cached = run(pair, prompts, cache)
    assert cached == [len(base) - 1, 25, len(base) - 1]
    assert outs == [reference(pair.target.model, p) for p in prompts]


def test_entries_are_compact_copies(tiny_pair):
    """An entry holds its own arrays, exactly its tokens long: not a view keeping a batch's
    buffers (grown 256 positions at a time, several rows) alive."""
    pair, _ = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    cache = PromptCache()
    long = PROMPT * 15  # arrays of tens of kilobytes: the allocator's rounding is lost in the noise
    run(pair, [long, long[:250] + [1, 2, 3]], cache)
    for entry in cache.entries.values():
        assert all(c.lengths == [len(entry.tokens)] for c in entry.cache)
        for c in entry.cache + entry.draft_cache:  # no room past what they hold (the drafter's window)
            assert c.keys.shape[:3] == (1, c.keys.shape[1], c.lengths[0])
        assert entry.nbytes == sum(c.keys.nbytes + c.values.nbytes for c in entry.cache + entry.draft_cache)
    assert cache.nbytes == sum(e.nbytes for e in cache.entries.values())
    # Letting the entries go frees their own bytes, not the buffers of the batch they came from.
    gc.collect()
    held, nbytes = mx.get_active_memory(), cache.nbytes
    del cache, entry, c
    gc.collect()
    assert 0.9 * nbytes <= held - mx.get_active_memory() <= 1.1 * nbytes, (held - mx.get_active_memory(), nbytes)


def test_ram_tier_is_bounded_in_bytes_least_recently_used_first(tiny_pair):
    pair, _ = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    prompts = [[10 + i] * 3 + PROMPT for i in range(4)]  # four conversations, no shared prefix
    probe = PromptCache()
    run(pair, prompts[:1], probe)
    size = probe.nbytes
    cache = PromptCache(max_entries=None, max_bytes=int(2.5 * size))
    for p in prompts[:2]:
        run(pair, [p], cache)
    assert cache.fetch(prompts[0] + [1])[0] == len(prompts[0])  # the first conversation's entry, used now
    run(pair, [prompts[2]], cache)  # over the bound: the second conversation's entry goes
    firsts = {e.tokens[0] for e in cache.entries.values()}
    assert cache.nbytes <= 2.5 * size and firsts == {10, 12}, firsts
    small = PromptCache(max_bytes=size // 2)
    run(pair, [prompts[3]], small)
    assert not small.entries and small.nbytes == 0  # an entry larger than the whole bound is not kept


def test_lookup_picks_the_longest_usable_prefix():
    index = PrefixIndex()
    a = list(range(100))
    index.add("a", a)
    index.add("b", a[:40] + [7] * 30)
    index.add("c", a[:70])
    index.add("short", [0, 1, 2])
    anything = lambda n, length: n >= 1  # noqa: E731
    whole = lambda n, length: n == length  # noqa: E731  (a recurrent state: entries serve whole only)
    assert index.longest(a[:90] + [5], anything) == (90, "a")
    assert index.longest(a[:40] + [7] * 10 + [1], anything) == (50, "b")
    assert index.longest(a[:90] + [5], whole) == (70, "c")  # "a" is deeper but cannot be cut
    assert index.longest([0, 1, 2, 3], whole) == (3, "short")
    assert index.longest(a[:70], anything)[0] == 69  # one prompt token is left to prefill
    assert index.longest([99, 1], anything) is None
    assert sorted(index.prefixes(a[:70] + [1])) == ["c", "short"]
    index.remove("a")
    assert index.longest(a[:90] + [5], anything) == (70, "c")


def test_lookup_never_trusts_a_hash(monkeypatch):
    """Every block colliding: the index still counts shared tokens one by one."""
    import dflash_mlx.cache.index as index_module

    monkeypatch.setattr(index_module, "_chain", lambda tokens: [0] * (len(tokens) // BLOCK + 1))
    index = PrefixIndex()
    index.add("x", list(range(64)))
    index.add("y", [5] * 64)
    assert index.longest(list(range(40)) + [0], lambda n, length: n >= 1) == (40, "x")
    assert index.longest([5] * 3 + [0] * 60, lambda n, length: n >= 1) == (3, "y")


def test_rebinding_to_another_pair_forgets_its_entries(tiny_pair):
    pair, _ = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    other = DFlashModel(pair.target, make_drafter_like(pair))
    cache = PromptCache()
    run(pair, [PROMPT], cache)
    (out,), (cached,) = run(other, [PROMPT + [3]], cache)
    assert cached == 0 and out == reference(pair.target.model, PROMPT + [3])


def make_drafter_like(pair):
    from dflash_mlx.models import Drafter

    mx.random.seed(7)
    drafter = Drafter(pair.drafter.args)
    mx.eval(drafter.parameters())
    return drafter


# -- the SSD tier's faults ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3(tiny_pair):
    pair, _ = dflash_mlx.load(*map(str, tiny_pair("qwen3")))
    return pair


def saved(pair, folder, prompt=PROMPT) -> list[Path]:
    """Run ``prompt`` with an SSD tier in ``folder``; the entry files written."""
    cache = PromptCache(directory=str(folder))
    run(pair, [prompt], cache)
    assert cache.flush(60)
    return sorted(Path(folder).glob("*.safetensors"))


def second_turn(pair, folder):
    """A fresh cache on ``folder`` serving the next turn (its own entry written before it returns):
    (cached tokens, disk hits); the answer is checked against mlx_lm."""
    prompt = PROMPT + reference(pair.target.model, PROMPT) + [3, 4]
    cache = PromptCache(directory=str(folder))
    (out,), (cached,) = run(pair, [prompt], cache)
    assert out == reference(pair.target.model, prompt)
    assert cache.flush(60)
    return cached, cache.disk_hits


def test_writes_happen_off_the_calling_thread(qwen3, tmp_path, monkeypatch):
    threads = []
    write = disk_module.write_entry
    monkeypatch.setattr(disk_module, "write_entry", lambda *a: threads.append(threading.current_thread()) or write(*a))
    assert saved(qwen3, tmp_path) and threads and threading.current_thread() not in threads


def test_truncated_file_is_removed_and_never_read(qwen3, tmp_path, caplog):
    (file,) = saved(qwen3, tmp_path)
    with open(file, "r+b") as f:
        f.truncate(file.stat().st_size - 100)
    with caplog.at_level(logging.WARNING, LOG):
        assert second_turn(qwen3, tmp_path) == (0, 0)
    assert not file.exists() and "(truncated or cut short)" in caplog.text


def test_corrupted_data_is_removed_and_never_read(qwen3, tmp_path, caplog):
    (file,) = saved(qwen3, tmp_path)
    data = bytearray(file.read_bytes())
    data[-50] ^= 0xFF  # one flipped byte in the keys and values: the header still reads well
    file.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, LOG):
        assert second_turn(qwen3, tmp_path) == (0, 0)
    assert not file.exists() and "its data does not match its checksum" in caplog.text


def test_files_of_another_model_are_never_read(qwen3, tiny_pair, tmp_path, caplog):
    (file,) = saved(qwen3, tmp_path)
    other_dir = tiny_pair("llama")
    other, _ = dflash_mlx.load(*map(str, other_dir))
    (mine,) = [f for f in saved(other, tmp_path, PROMPT[:15]) if f != file]
    # Another model's file is left alone (the folder is shared); one renamed to look like ours is removed.
    impostor = tmp_path / f"{mine.name[:16]}-{'0' * 32}.safetensors"
    shutil.copy(file, impostor)
    cache = PromptCache(directory=str(tmp_path))
    with caplog.at_level(logging.WARNING, LOG):
        (out,), (cached,) = run(other, [PROMPT + [3]], cache)
    assert cached == 15 and cache.disk_hits == 1  # its own entry, not the other model's longer one
    assert out == reference(other.target.model, PROMPT + [3])
    assert file.exists() and not impostor.exists() and "written for another model" in caplog.text


def test_a_writer_killed_mid_write_leaves_nothing_wrong(qwen3, tiny_pair, tmp_path, caplog):
    script = f"""
import os, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
import dflash_mlx
from dflash_mlx import PromptCache
from dflash_mlx.cache import disk
from test_prompt_cache import PROMPT, run
pair, _ = dflash_mlx.load(*{list(map(str, tiny_pair("qwen3")))!r})
cache = PromptCache(directory={str(tmp_path)!r})
run(pair, [PROMPT], cache)
cache.flush(60)
disk.os.fsync = lambda fd: (print("writing", flush=True), time.sleep(600))  # a slow disk, mid-write
run(pair, [[9] * 30], cache)
time.sleep(600)
"""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        assert child.stdout.readline() == "writing\n"
        temps = list(tmp_path.glob("*.tmp-*"))
        assert temps and temps[0].stat().st_size > 0
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    with caplog.at_level(logging.INFO, LOG):
        cached, hits = second_turn(qwen3, tmp_path)
    assert (cached, hits) == (len(PROMPT) + N - 1, 1)  # the complete file serves; the partial one is gone
    assert not list(tmp_path.glob("*.tmp-*")) and "left by a writer that stopped" in caplog.text
    # The next turn's entry extends the one it was served from, which it replaces.
    assert len(list(tmp_path.glob("*.safetensors"))) == 1


def test_simulated_full_disk_costs_caching_never_a_request(qwen3, tmp_path, monkeypatch, caplog):
    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_module.os, "fsync", full)
    with caplog.at_level(logging.WARNING, LOG):
        assert saved(qwen3, tmp_path) == []
        assert second_turn(qwen3, tmp_path) == (0, 0)  # answered, exactly, without a file
    assert caplog.text.count("No space left on device") == 2  # once per cache: logged once, then off
    assert not list(tmp_path.iterdir())  # no temp file left behind


@pytest.fixture
def mounted(tmp_path):
    """Mount helper: skips the test where mount needs privileges this process lacks."""
    points = []

    def mount(*argv, point):
        point.mkdir(exist_ok=True)
        if subprocess.run(["mount", *argv, str(point)], capture_output=True).returncode:
            pytest.skip("mount is not permitted here")
        points.append(point)
        return point

    yield mount
    for point in reversed(points):
        subprocess.run(["umount", str(point)], capture_output=True)


def test_full_tmpfs_costs_caching_never_a_request(qwen3, tmp_path, mounted, monkeypatch, caplog):
    folder = mounted("-t", "tmpfs", "-o", "size=16k", "tmpfs", point=tmp_path / "small")
    with caplog.at_level(logging.WARNING, LOG):
        assert saved(qwen3, folder) == []  # the entry is over half the free space: not written
        assert second_turn(qwen3, folder) == (0, 0)
        assert "No space left on device" not in caplog.text  # refused before trying
        # Told there is room, the writer meets the real ENOSPC: logged, off, nothing left behind.
        monkeypatch.setattr(disk_module.shutil, "disk_usage", lambda path: SimpleNamespace(free=2**40))
        assert saved(qwen3, folder) == []
    assert "No space left on device" in caplog.text and not list(folder.iterdir())


def test_unwritable_folders_cost_caching_never_a_request(qwen3, tmp_path, mounted, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with caplog.at_level(logging.WARNING, LOG):
        assert second_turn(qwen3, blocker / "cache") == (0, 0)
    assert "cannot write to" in caplog.text
    source = tmp_path / "source"
    saved(qwen3, source)
    read_only = mounted("--bind", str(source), point=tmp_path / "ro")
    subprocess.run(["mount", "-o", "remount,bind,ro", str(read_only)], check=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, LOG):
        # Reads work, writes are off (logged once), the answer is exact.
        assert second_turn(qwen3, read_only) == (len(PROMPT) + N - 1, 1)
    assert caplog.text.count("cannot write to") == 1


def test_disk_tier_is_bounded_in_bytes(qwen3, tmp_path):
    sizes = [f.stat().st_size for f in saved(qwen3, tmp_path / "probe")]
    cache = PromptCache(directory=str(tmp_path / "c"), max_disk_bytes=int(2.5 * sizes[0]))
    for i in range(4):
        run(qwen3, [[10 + i] * 3 + PROMPT], cache)
        cache.flush(60)
        time.sleep(0.01)  # distinct modification times
    files = list((tmp_path / "c").glob("*.safetensors"))
    assert len(files) == 2 and sum(f.stat().st_size for f in files) <= 2.5 * sizes[0]
    assert cache.disk_bytes == sum(f.stat().st_size for f in files)
    assert {t[0] for t in cache.disk.index.tokens.values()} == {12, 13}  # the oldest went first


# -- a server process ------------------------------------------------------------------------------


def chat(port, messages):
    body = {"messages": messages, "max_tokens": 8, "temperature": 0.0, "logit_bias": NO_EOS}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    reply = json.loads(conn.getresponse().read())
    conn.close()
    return reply["choices"][0]["message"]["content"], reply["usage"]


def metric(port, name):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return float(re.search(rf"^dflash_{name} (\S+)$", text, re.M).group(1))


@pytest.mark.slow  # two server processes, ~11 s: outside the default run, as test_server_process.py
def test_server_prefills_only_the_suffix_and_hits_after_a_restart(pair, tmp_path):
    argv = ("--model", pair[0], "--draft", pair[1], "--port", "0", "--prompt-cache-dir", str(tmp_path))
    server = Serve(*argv)
    try:
        port = server.port()
        question = [{"role": "user", "content": "Tell me a story about a fox."}]
        reply, first = chat(port, question)
        assert first["prompt_tokens_details"]["cached_tokens"] == 0
        turn = question + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And then?"}]
        answer, usage = chat(port, turn)
        # All of the first exchange the caches held (the reply's last token never entered them).
        assert usage["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] + 8 - 1
        assert metric(port, "prompt_cache_ram_hits_total") == 1 and metric(port, "prompt_cache_disk_bytes") > 0
    finally:
        server.proc.send_signal(signal.SIGTERM)
        code, log = server.wait()
    assert code == 0, log
    server = Serve(*argv)  # a new process on the same folder
    try:
        port = server.port()
        again, usage = chat(port, turn)
        assert again == answer and usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        assert metric(port, "prompt_cache_disk_hits_total") == 1 and metric(port, "prompt_cache_misses_total") == 0
    finally:
        server.proc.send_signal(signal.SIGTERM)
        server.wait()
