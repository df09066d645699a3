"""Record what real agent clients send: Claude Code, Codex, the openai-agents SDK and
the official openai / anthropic Python SDKs, each pointed at a recording server on
127.0.0.1, then scrub the requests into tests/data/traffic/ (one JSON file a request).

Not run in CI: it installs the CLIs from the npm registry and takes a minute or so.

    python -m tools.recorder [--clients claude,codex,agents,sdk]
        [--claude-version latest] [--codex-version latest] [--no-install] [--scrub-only]
        [--runs claude_code.session2,claude_code.interactive,claude_code.first_party]

One module per concern: replies.py (the scripted answers), server.py (the recorder),
clients.py (running each client), scrub.py (the requests made reproducible),
inventory.py (the README's field inventory), __main__.py (the command).

What it does:

1. `npm install @anthropic-ai/claude-code@V @openai/codex@V` into conformance/.cache/npm
   (conformance/agent_clis.py, shared with conformance/agents.py), and `openai-agents`
   into a throwaway venv conformance/.cache/agents-venv.
2. Starts the recorder: a stdlib HTTP server on a free port of 127.0.0.1 that writes
   every request (method, path with query, headers, body) to
   conformance/.cache/traffic-raw/NNN-....json and answers with minimal, scripted,
   well-formed replies in each API's shape (Anthropic Messages, streamed or whole,
   and count_tokens; OpenAI Responses and chat completions, streamed or whole; model
   lists; 200 to HEAD/GET probes). A first turn whose prompt carries CUE is answered
   with a tool call (Claude Code's Bash, Codex's shell tool, the SDKs' function
   tool); a request that carries the tool's result is answered with text that ends
   the turn; anything else with one line of text.
3. Runs each client for two turns in a scratch HOME (a temp dir outside any git
   repository, removed afterwards), the second continuing the first session (`claude -p
   --continue`, `codex exec resume --last`), with the clients' telemetry, update checks
   and nonessential traffic switched off; then Claude Code once more as most users run
   it (a Claude model name, nonessential traffic on), and the EXTRA_RUNS, each in a
   scratch HOME of its own: a second `claude -p` session with another task, and one turn
   of an interactive session driven in tmux (as is, and taking the recorder for
   Anthropic's own API). `--runs` records only some of those and adds their files to
   what is there, rewriting nothing else. Every client talks only to the
   recorder (the CLIs get no other base URL), and each runs under a timeout in its own
   process group, killed at the end.
4. Scrubs the requests (auth values, scratch paths, host name, ids, dates, unix times,
   kernel release) into tests/data/traffic/<client>_<turn>.json, index.json (the runs,
   the files, their sizes) and the generated part of tests/data/traffic/README.md (the
   file list and the field inventory: every header, query parameter, body field and
   tool-schema keyword each client sent). Re-recording gives the same request files.
"""
