"""`jaxinfer chat`: an interactive, streaming conversation in the terminal.

Line editing and history come from readline. Ctrl-C while a reply streams stops that reply (its blocks are
freed) and the session carries on; Ctrl-C at the prompt or Ctrl-D quits. When the conversation no longer
fits max_model_len, the oldest turns are dropped (the system prompt stays) and the user is told.
"""
from __future__ import annotations

import sys

HELP = """commands:
  /help    this list
  /reset   forget the conversation (the system prompt stays)
  /exit    quit (also /quit, Ctrl-D)
Ctrl-C stops a reply that is streaming; Ctrl-C at the prompt quits."""


def _readline() -> None:
    try:
        import readline  # noqa: F401  (importing it gives input() line editing and history)
    except ImportError:     # not on every platform
        pass


def fit_history(llm, history: list[dict], kwargs: dict | None, max_tokens: int) -> tuple[str, int]:
    """(prompt, turns dropped): the newest turns whose rendered prompt leaves room for a reply of up to
    max_tokens (at least a quarter of max_model_len). The system message and the last user turn stay."""
    limit = llm.config.max_model_len
    room = max(1, min(max_tokens or limit, limit // 4))
    system = history[:1] if history and history[0]["role"] == "system" else []
    turns = history[len(system):]
    dropped = 0
    while True:
        prompt = llm.apply_chat_template(system + turns, kwargs)
        n = len(llm.get_tokenizer().encode(prompt, add_special_tokens=False))
        if n + room <= limit or len(turns) <= 1:
            return prompt, dropped
        turns = turns[2:] if len(turns) > 2 else turns[1:]     # a user turn and its reply
        dropped += 1


def chat_loop(llm, sp, system: str | None = None, thinking: bool = True) -> int:
    _readline()
    kwargs = None if thinking else {"enable_thinking": False}
    history = [{"role": "system", "content": system}] if system else []
    print("chat: type a message; /help lists the commands.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt, RuntimeError):     # (RuntimeError: stdin closed, "lost sys.stdin")
            print()
            return 0
        if not line:
            continue
        if line.startswith("/"):
            cmd = line.split()[0]
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/reset":
                history = history[:1] if system else []
                print("(conversation cleared)", file=sys.stderr)
            elif cmd == "/help":
                print(HELP, file=sys.stderr)
            else:
                print(f"unknown command {cmd!r}; /help lists the commands", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        prompt, dropped = fit_history(llm, history, kwargs, sp.max_tokens)
        reply, stream = [], None
        try:
            ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)     # (the template has them)
            stream = llm.stream({"prompt": prompt, "prompt_token_ids": ids}, sp)    # (bad input raises here)
            if dropped:
                keep = 1 if system else 0
                del history[keep:keep + 2 * dropped]
                print(f"(dropped the {dropped} oldest turn(s) to fit max_model_len={llm.config.max_model_len})",
                      file=sys.stderr)
            for d in stream:
                print(d.text, end="", flush=True)
                reply.append(d.text)
        except KeyboardInterrupt:
            if stream is not None:
                stream.close()            # aborts the request: its KV blocks go back
            print(" [stopped]", end="")
        except ValueError as e:           # this message cannot be answered (longer than max_model_len, ...):
            print(f"error: {e}", file=sys.stderr)       # it leaves the conversation, and the session goes on
            history.pop()
            continue
        print()
        history.append({"role": "assistant", "content": "".join(reply)})
