"""Time to first token of an agent-like session: cold, from the RAM tier, and from files after a restart.

    python benchmarks/bench_prefix_cache.py [--rounds 2] [--max-tokens 48] [--out benchmarks/results/prefix_cache.json]

Two servers on the built-in pair's target (``dflash_mlx.default``), started as bench_serve.py starts
them: ``dflash-mlx serve --prompt-cache-dir DIR`` (defaults otherwise) and ``mlx_lm.server``.

The session: a system prompt of about 4k tokens (an agent's rules and its tools' JSON schemas), then
8 user turns, each a tool result of about 100 tokens and a request; every reply is the model's own
(greedy, ``--max-tokens`` each), so the history grows as an agent's does and stays under SmolLM2's
8192-token context. Both servers get every turn, taking turns request by request (the first to go
alternates), so a busy spell on this shared machine falls on both. TTFT is the time from sending a
streaming chat request to its first content. Then both servers are stopped (SIGTERM: ours writes
what it has queued) and started again, ours on the same folder, and a 9th turn is sent: ours serves
it from the files (the SSD tier), mlx_lm.server cold (it keeps nothing across a restart).

Each round starts from fresh servers and an empty folder; the table shows the median over rounds of
turn 1 (cold), turns 2-8 (RAM hits) and turn 9 (after the restart), and the goals: a RAM hit at most
10% of the cold time, an SSD hit at most 25%, ours no slower than mlx_lm.server cold and warm.
``exact`` says whether both servers wrote the same replies (greedy: they must).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from bench_serve import MLX_LM_SERVER, start
from mlx_lm.tokenizer_utils import load as load_tokenizer

from dflash_mlx.default import default_pair

TARGET_SYSTEM_TOKENS = 4000
RULES = """You are a coding agent working in a user's repository. You act through the tools below and
nothing else. Before you change a file, read it. Keep changes small and explain each in one sentence.
When a command fails, read its output and fix the cause instead of retrying. Never invent file
contents, paths or command results; if you need something, call a tool. Reply with a tool call in
JSON ({"tool": NAME, "arguments": {...}}) or, when the task is done, with a short summary."""
TOOLS = [
    ("read_file", "Read a text file of the workspace and return it with line numbers.",
     [("path", "string", "Path relative to the workspace root."), ("start_line", "integer", "First line to return."),
      ("end_line", "integer", "Last line to return, inclusive.")]),
    ("write_file", "Create or overwrite a file with the given contents.",
     [("path", "string", "Path relative to the workspace root."), ("contents", "string", "The whole new text.")]),
    ("edit_file", "Replace one exact occurrence of a string in a file.",
     [("path", "string", "File to edit."), ("old", "string", "Text to find; must occur exactly once."),
      ("new", "string", "Replacement text.")]),
    ("list_directory", "List the entries of a folder with their sizes and kinds.",
     [("path", "string", "Folder to list."), ("depth", "integer", "How many levels to descend (default 1).")]),
    ("search_code", "Search the workspace for a regular expression and return matching lines.",
     [("pattern", "string", "A Python regular expression."), ("glob", "string", "Only files matching this glob."),
      ("max_results", "integer", "Stop after this many matches.")]),
    ("run_command", "Run a shell command in the workspace and return its exit code, stdout and stderr.",
     [("command", "string", "The command line."), ("timeout", "integer", "Seconds before it is killed."),
      ("cwd", "string", "Folder to run it in, relative to the root.")]),
    ("run_tests", "Run the test suite or a subset of it and return the failures.",
     [("selector", "string", "A test file, class or function to run."), ("verbose", "boolean", "Show every test.")]),
    ("git_status", "Show changed, staged and untracked files.", []),
    ("git_diff", "Show the diff of the working tree or of a commit range.",
     [("range", "string", "A commit range such as HEAD~3..HEAD."), ("path", "string", "Limit to this path.")]),
    ("git_commit", "Commit the staged changes.",
     [("message", "string", "The commit message."), ("all", "boolean", "Stage every tracked change first.")]),
    ("git_log", "Show recent commits.", [("count", "integer", "How many."), ("path", "string", "Only this path.")]),
    ("open_issue", "Read an issue of the project tracker with its comments.",
     [("number", "integer", "The issue number.")]),
    ("comment_issue", "Add a comment to an issue.",
     [("number", "integer", "The issue number."), ("body", "string", "Markdown text.")]),
    ("fetch_url", "Download a web page and return its text.",
     [("url", "string", "An http or https address."), ("max_bytes", "integer", "Truncate after this many bytes.")]),
    ("python_eval", "Evaluate a Python expression in a sandbox and return its repr.",
     [("expression", "string", "The expression."), ("imports", "array", "Modules to import first.")]),
    ("format_code", "Format files with the project's formatter.",
     [("paths", "array", "Files or folders."), ("check", "boolean", "Report only, change nothing.")]),
    ("lint", "Run the linter and return its findings.",
     [("paths", "array", "Files or folders."), ("fix", "boolean", "Apply safe fixes.")]),
    ("type_check", "Run the type checker and return its errors.", [("paths", "array", "Files or folders.")]),
    ("find_definition", "Find where a symbol is defined.",
     [("symbol", "string", "A function, class or variable name."), ("language", "string", "python, rust, go...")]),
    ("find_references", "Find every use of a symbol.", [("symbol", "string", "The name."),
                                                         ("path", "string", "Limit to this folder.")]),
    ("ask_user", "Ask the user a question and wait for the answer.", [("question", "string", "One question.")]),
    ("remember", "Store a note for later turns of this session.", [("key", "string", "Name."),
                                                                   ("value", "string", "Note.")]),
    ("recall", "Read a note stored earlier.", [("key", "string", "Name.")]),
    ("benchmark", "Time a command over several runs and return the median and spread.",
     [("command", "string", "The command line."), ("runs", "integer", "How many runs.")]),
]
TURNS = [
    ("list_directory", "src/  4096 dir\ntests/  4096 dir\npyproject.toml  1203\nREADME.md  5532\n"
     "src/app/__init__.py  88\nsrc/app/server.py  9123\nsrc/app/cache.py  4410\nsrc/app/config.py  2301",
     "Find out why requests get slower after a few hours of uptime."),
    ("read_file", "1 import time\n2 from collections import OrderedDict\n3\n4 class Cache:\n5     def __init__(self):\n"
     "6         self.items = OrderedDict()\n7     def put(self, key, value):\n8         self.items[key] = (time.time(), value)\n"
     "9     def get(self, key):\n10        return self.items.get(key, (0, None))[1]",
     "That is src/app/cache.py. What is wrong with it?"),
    ("search_code", "src/app/server.py:88:    cache.put(request.path, response)\nsrc/app/server.py:131:    "
     "cache.put(session_id, state)\ntests/test_cache.py:12:    cache.put('a', 1)", "Where is it used, and with which keys?"),
    ("run_tests", "FAILED tests/test_cache.py::test_eviction - AssertionError: 1001 != 1000\n"
     "1 failed, 41 passed in 3.2s", "I added a test that fills it. Fix the cache so it passes."),
    ("edit_file", "Edited src/app/cache.py: 1 replacement.", "Now run the tests again."),
    ("run_tests", "42 passed in 3.1s", "Good. Is anything else in server.py keeping memory?"),
    ("read_file", "120     sessions = {}\n121     def handle(self, request):\n122         state = sessions.setdefault("
     "request.session, {})\n123         state['history'].append(request.body)", "Fix that too, with a bound."),
    ("git_diff", "src/app/cache.py | 9 +++++++--\nsrc/app/server.py | 6 ++++--\n2 files changed", "Write the commit message."),
    ("git_commit", "[main 3f2a1c9] Bound the response cache and the session history", "Summarise what we did today."),
]


def system_prompt(tokenizer) -> str:
    """The rules and as many tool schemas as make about ``TARGET_SYSTEM_TOKENS`` tokens (the list
    repeats with numbered variants when it runs out: agents' tool lists are long)."""
    parts, n, variant = [RULES, "\nTools:"], 0, 0
    while True:
        for name, description, params in TOOLS:
            schema = {"name": f"{name}_{variant}" if variant else name, "description": description,
                      "input_schema": {"type": "object",
                                       "properties": {p: {"type": t, "description": d} for p, t, d in params},
                                       "required": [p for p, _, _ in params[:1]]}}
            parts.append(json.dumps(schema, indent=1))
            n = len(tokenizer.encode("\n".join(parts)))
            if n >= TARGET_SYSTEM_TOKENS:
                return "\n".join(parts)
        variant += 1


def ask(port: int, messages: list[dict], max_tokens: int, eos: int) -> tuple[float, str, int]:
    """(seconds to the first content, the reply, cached prompt tokens the usage reports)."""
    body = {"model": "default_model", "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": {str(eos): -100.0}}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    tic, first, text, cached = time.perf_counter(), None, "", 0
    with urllib.request.urlopen(request, timeout=3600) as reply:
        for line in reply:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content") or ""
                if content and first is None:
                    first = time.perf_counter() - tic
                text += content
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return first if first is not None else time.perf_counter() - tic, text, cached


def session_round(commands: dict, system: str, max_tokens: int, eos: int) -> dict:
    """One round: fresh servers, 8 turns, a restart, a 9th turn. Per system, per turn: TTFT, cached."""
    histories = {name: [{"role": "system", "content": system}] for name in commands}
    runs = {name: [] for name in commands}
    servers = {name: start(name, argv) for name, argv in commands.items()}
    try:
        for turn, (tool, result, request) in enumerate(TURNS):
            if turn == len(TURNS) - 1:  # the restart: ours keeps its files, mlx_lm.server keeps nothing
                for process, _ in servers.values():
                    process.terminate()
                    process.wait()
                servers = {name: start(name, argv) for name, argv in commands.items()}
            names = list(commands) if turn % 2 == 0 else list(reversed(commands))
            for name in names:
                history = histories[name]
                history.append({"role": "user", "content": f"Tool {tool} returned:\n{result}\n\n{request}"})
                seconds, reply, cached = ask(servers[name][1], history, max_tokens, eos)
                history.append({"role": "assistant", "content": reply})
                runs[name].append(dict(ttft=seconds, cached_tokens=cached, reply=reply))
    finally:
        for process, _ in servers.values():
            process.terminate()
            process.wait()
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    target, draft = default_pair()
    tokenizer = load_tokenizer(Path(target))
    eos = tokenizer.eos_token_id
    system = system_prompt(tokenizer)
    rounds = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="prefix-cache-") as folder:
            commands = {
                "dflash": [sys.executable, "-m", "dflash_mlx", "serve", "--model", target, "--draft", draft,
                           "--prompt-cache-dir", folder],
                "mlx_lm": [sys.executable, "-c", MLX_LM_SERVER, "--model", target],
            }
            rounds.append(session_round(commands, system, args.max_tokens, eos))
    phases = {"cold": [0], "ram": list(range(1, len(TURNS) - 1)), "after restart": [len(TURNS) - 1]}
    table = {}
    for name in rounds[0]:
        table[name] = {phase: statistics.median(statistics.median(r[name][t]["ttft"] for t in turns) for r in rounds)
                       for phase, turns in phases.items()}
    exact = all(r["dflash"][t]["reply"] == r["mlx_lm"][t]["reply"] for r in rounds for t in range(len(TURNS)))
    print(f"system prompt {len(tokenizer.encode(system))} tokens, {len(TURNS) - 1} turns and one after a restart, "
          f"{args.rounds} rounds; "
          f"replies identical: {exact}")
    print(f"{'phase':>14} {'dflash s':>9} {'mlx_lm s':>9} {'dflash/cold':>12} {'mlx_lm/cold':>12} {'dflash/mlx_lm':>14}")
    for phase in phases:
        d, m = table["dflash"][phase], table["mlx_lm"][phase]
        print(f"{phase:>14} {d:>9.3f} {m:>9.3f} {d / table['dflash']['cold']:>12.3f} "
              f"{m / table['mlx_lm']['cold']:>12.3f} {d / m:>14.2f}")
    goals = {"ram hit <= 10% of cold": table["dflash"]["ram"] <= 0.10 * table["dflash"]["cold"],
             "ssd hit after restart <= 25% of cold": table["dflash"]["after restart"] <= 0.25 * table["dflash"]["cold"],
             "cold no slower than mlx_lm": table["dflash"]["cold"] <= table["mlx_lm"]["cold"],
             "warm no slower than mlx_lm": table["dflash"]["ram"] <= table["mlx_lm"]["ram"]}
    for goal, met in goals.items():
        print(f"{goal}: {'met' if met else 'NOT met'}")
    if args.out:
        for r in rounds:
            for runs in r.values():
                for run in runs:
                    run.pop("reply")
        args.out.write_text(json.dumps(dict(system_tokens=len(tokenizer.encode(system)), turns=len(TURNS),
                                            max_tokens=args.max_tokens, load=os.getloadavg(), exact=exact,
                                            median_ttft=table, goals=goals, rounds=rounds), indent=1))


if __name__ == "__main__":
    main()
