#!/usr/bin/env python3
"""A real SMTP server for tests, built on aiosmtpd.

Listens on 127.0.0.1 (port 0 = any free port), prints `127.0.0.1:<port>` on stdout once it
accepts connections, stores each accepted message as `<dir>/<seq>.eml` (raw bytes as received)
plus `<seq>.json` (envelope: mail_from, rcpt_tos, auth_user, tls), and exits when its standard
input reaches end-of-file, so a test process that dies never leaves it behind.

Standard input also takes commands, one per line, each answered with one line on stdout:
  fail <code> <count>   answer <code> (e.g. 451 or 550) to the next <count> messages' DATA
                        (nothing is stored: a definitive refusal)
  hang <count>          store the next <count> messages, then never answer their DATA (the
                        client cannot tell that they were accepted)
  nogreet <count>       accept the next <count> connections and never greet them (nothing can
                        be sent on them)
  slow <ms> <count>     answer the next <count> messages' DATA <ms> milliseconds late, then
                        store them and answer 250 as usual
  reset                 stop all of the above (sessions already hanging stay so until the
                        client gives up)
"""

import argparse
import asyncio
import json
import os
import ssl
import sys

from aiosmtpd.smtp import SMTP, AuthResult, LoginPassword

REPLIES = {
    421: "421 4.3.2 Service not available, try later",
    450: "450 4.2.0 Mailbox unavailable, try later",
    451: "451 4.3.0 Requested action aborted: local error, try later",
    452: "452 4.3.1 Insufficient system storage",
    550: "550 5.1.1 Mailbox unavailable",
    552: "552 5.3.4 Message too big",
    554: "554 5.7.1 Transaction failed",
}


class Handler:
    def __init__(self, directory):
        self.directory = directory
        self.seq = 0
        self.reset()

    def reset(self):
        self.fail_code = None
        self.fail_count = 0
        self.hang_count = 0
        self.nogreet_count = 0
        self.slow_ms = 0
        self.slow_count = 0

    async def handle_DATA(self, server, session, envelope):
        if self.fail_count > 0:
            self.fail_count -= 1
            return REPLIES.get(self.fail_code, f"{self.fail_code} Failure requested by the test")
        if self.slow_count > 0:
            self.slow_count -= 1
            await asyncio.sleep(self.slow_ms / 1000)
        hang = self.hang_count > 0
        if hang:
            self.hang_count -= 1
        reply = self.store(server, session, envelope)
        if hang:
            # Stored, and no answer ever: the session ends when the client gives up (aiosmtpd
            # cancels this coroutine when the connection is lost).
            await asyncio.Event().wait()
        return reply

    def store(self, server, session, envelope):
        self.seq += 1
        base = os.path.join(self.directory, f"{self.seq:06d}")
        tls = session.ssl is not None or (
            server.transport is not None
            and server.transport.get_extra_info("ssl_object") is not None
        )
        meta = {
            "mail_from": envelope.mail_from,
            "rcpt_tos": list(envelope.rcpt_tos),
            "auth_user": session.auth_data.login.decode()
            if isinstance(session.auth_data, LoginPassword)
            else None,
            "tls": tls,
        }
        # Write to temporary names, then rename: a reader never sees half a message.
        with open(base + ".json.tmp", "w") as f:
            json.dump(meta, f)
        with open(base + ".eml.tmp", "wb") as f:
            f.write(envelope.original_content)
        os.rename(base + ".json.tmp", base + ".json")
        os.rename(base + ".eml.tmp", base + ".eml")
        return "250 2.0.0 OK: queued as %06d" % self.seq


class Silent(asyncio.Protocol):
    """A connection that is accepted and never greeted; whatever the client sends is ignored."""

    def connection_made(self, transport):
        self.transport = transport


def make_authenticator(user, password):
    def authenticate(server, session, envelope, mechanism, auth_data):
        ok = (
            isinstance(auth_data, LoginPassword)
            and auth_data.login.decode() == user
            and auth_data.password.decode() == password
        )
        # handled=False: let aiosmtpd answer 535 itself; auth_data: recorded with each message.
        return AuthResult(success=ok, handled=False, auth_data=auth_data)

    return authenticate


def answer(line):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--dir", required=True, help="where received messages are stored")
    p.add_argument("--tls", choices=["none", "starttls", "starttls-required", "implicit"], default="none")
    p.add_argument("--cert", help="server certificate chain (PEM), for any TLS mode")
    p.add_argument("--key", help="server private key (PEM)")
    p.add_argument("--auth-user", help="require AUTH PLAIN/LOGIN with this user")
    p.add_argument("--auth-password", default=os.environ.get("SMTP_TEST_PASSWORD"),
                   help="the password (or env SMTP_TEST_PASSWORD)")
    args = p.parse_args()

    os.makedirs(args.dir, exist_ok=True)
    context = None
    if args.tls != "none":
        if not (args.cert and args.key):
            p.error("--cert and --key are required with --tls")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.cert, args.key)

    handler = Handler(args.dir)
    kwargs = dict(hostname="mail.test", ident="capm test SMTP server")
    if args.tls in ("starttls", "starttls-required"):
        kwargs.update(tls_context=context, require_starttls=args.tls == "starttls-required")
    if args.auth_user:
        if args.auth_password is None:
            p.error("--auth-user needs --auth-password or SMTP_TEST_PASSWORD")
        kwargs.update(
            authenticator=make_authenticator(args.auth_user, args.auth_password),
            auth_required=True,
            # Plain-text AUTH is allowed only without any TLS configured (then it is the point).
            auth_require_tls=args.tls != "none",
        )

    loop = asyncio.get_running_loop()
    def protocol():
        if handler.nogreet_count > 0:
            handler.nogreet_count -= 1
            return Silent()
        return SMTP(handler, **kwargs)

    server = await loop.create_server(
        protocol,
        host="127.0.0.1",
        port=args.port,
        ssl=context if args.tls == "implicit" else None,
    )
    port = server.sockets[0].getsockname()[1]
    answer(f"127.0.0.1:{port}")

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    while True:
        line = await reader.readline()
        if not line:
            break  # EOF: the owner is gone
        words = line.decode().split()
        if len(words) == 3 and words[0] == "fail":
            handler.fail_code, handler.fail_count = int(words[1]), int(words[2])
            answer("ok")
        elif len(words) == 2 and words[0] == "hang":
            handler.hang_count = int(words[1])
            answer("ok")
        elif len(words) == 2 and words[0] == "nogreet":
            handler.nogreet_count = int(words[1])
            answer("ok")
        elif len(words) == 3 and words[0] == "slow":
            handler.slow_ms, handler.slow_count = int(words[1]), int(words[2])
            answer("ok")
        elif words == ["reset"]:
            handler.reset()
            answer("ok")
        elif words:
            answer("error: unknown command")
    server.close()


if __name__ == "__main__":
    asyncio.run(main())
