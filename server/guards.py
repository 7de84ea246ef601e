"""Checks every HTTP request passes before gradio or the OpenAI routes see it (an ASGI
middleware around the whole app):

- Host: with no logins (loopback mode) only the names the app is served under are answered
  (localhost, 127.0.0.1, ::1, the bound host, and any --allowed-host). A page on another site
  can resolve its own name to 127.0.0.1 (DNS rebinding) and then drive the app as if it were
  this machine's user, unload_model included; its requests carry its own Host name.
- Content-Type: with no logins, POST /v1/... must be application/json. A cross-site page may
  send text/plain without the browser asking first (no CORS preflight); it may not send JSON.
- Logins: FastAPI's schema and docs (/openapi.json, /docs, /redoc) need one when logins are on.
- Logins: failures logged and limited (login_limit.py), on /login and wherever a login is
  taken from the Authorization header (/v1/..., the docs): a wrong one is a 401 here, and one
  for a user name that failed too often a 429 with Retry-After, before any route sees it. A
  page session of a user taken out of --auth-file ends at its next request (logins.py reads
  the file again).
- Images: every response says (Content-Security-Policy) that the page loads images and media
  from this app only (and data:/blob: URLs). A reply or an imported conversation may hold
  ![](http://elsewhere/pixel) or <img src=http://...>, which the chatbot's Markdown draws: the
  browser would fetch it, telling an outside server who reads what (a tracking pixel), or
  reaching an address inside the user's network. The browser refuses those fetches.
- JSON bodies: parsed once here by request_models.parse_json, so that a body gradio or the
  OpenAI route could not parse safely (100 000 nested brackets, a lone surrogate) is a 400 with
  a plain message instead of a RecursionError or a TypeError deep inside.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import math

from starlette.middleware import Middleware

from .errors import ClientError
from .login_limit import LOGIN_PATHS, MAX_FORM_BYTES, LoginLimiter, form_user
from .logins import Logins
from .request_models import MAX_JSON_BYTES, parse_json

log = logging.getLogger("ui")

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
DOCS_PATHS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
REALM = 'Bearer realm="Qwen chat"'
# What the page may load images and media from: this app only.
CONTENT_POLICY = b"img-src 'self' data: blob:; media-src 'self' data: blob:"


def given_login(authorization: str) -> tuple[str, str]:
    """(user, password) of "Bearer user:password" or HTTP basic auth. A token without a colon
    (an API key meant for another server) names no user: ("", token), so that the key is
    never logged as a user name."""
    scheme, _, value = authorization.partition(" ")
    given = ""
    if scheme.lower() == "bearer":
        given = value.strip()
    elif scheme.lower() == "basic":
        try:
            given = base64.b64decode(value.strip(), validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            given = ""
    user, colon, password = given.partition(":")
    return (user, password) if colon else ("", given)


def login_user(authorization: str, logins: list[tuple[str, str]]) -> str | None:
    """The user named by "Bearer user:password" or HTTP basic auth, if the login is right."""
    user, password = given_login(authorization)
    # Every login is compared, so the time taken does not tell which user exists.
    found = None
    for known_user, known_password in logins:
        if hmac.compare_digest(f"{user}:{password}".encode(),
                               f"{known_user}:{known_password}".encode()):
            found = known_user
    return found


def host_name(host: str) -> str:
    """"127.0.0.1:7860" -> "127.0.0.1", "[::1]:7860" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class RequestGuard:
    """The middleware; `request_guard` makes its entry for the app's middleware list."""

    def __init__(self, app, *, logins: Logins | None,
                 allowed_hosts: set[str] | None):
        self.app = app
        if isinstance(logins, list):
            logins = Logins(logins)
        self.logins = logins if logins else []
        self.login_limiter = LoginLimiter()
        # Logins protect the app on their own (and a share link has a Host of its own).
        self.allowed_hosts = {h.lower() for h in allowed_hosts} \
            if allowed_hosts and not self.logins else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            if scope["type"] == "websocket" and not self._host_ok(scope):
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.app(scope, receive, send)
            return
        if self.logins:
            self._end_sessions_of_removed_users(scope)
        try:
            receive = await self._check(scope, receive)
            if self.logins and scope["method"] == "POST" and scope["path"] in LOGIN_PATHS:
                receive, send = await self._limit_login(scope, receive, send)
        except ClientError as error:
            await self._refuse(scope, send, error)
            return
        await self.app(scope, receive, _with_content_policy(send))

    async def _limit_login(self, scope, receive, send):
        body = await _read_body(receive, MAX_FORM_BYTES)
        user = form_user(body)
        address = _address(scope)
        self._refuse_if_limited(address, user)

        async def watch(message):  # gradio answers 400 to wrong credentials
            if message["type"] == "http.response.start":
                if message["status"] == 400:
                    self.login_limiter.failed(address, user, "login form")
                elif message["status"] < 400:
                    self.login_limiter.succeeded(address, user)
            await send(message)

        return _replay(body, receive), watch

    def _refuse_if_limited(self, address: str, user: str) -> None:
        wait = self.login_limiter.wait_s(address, user)
        if wait > 0:
            log.warning("login refused for user %r from %s: too many failed logins",
                        user[:64], address)
            raise ClientError(429, "too many failed logins for this user: try again in "
                              f"{wait:.0f} s", retry_after=str(math.ceil(wait)))

    def _check_login_header(self, scope) -> bool:
        """The login in the Authorization header, if there is one: True when it is right; a
        wrong one is counted as a failed login (401), one for a user name that failed too often
        is refused (429) however right. No header: False (the route says a login is needed)."""
        authorization = _header(scope, b"authorization")
        if not authorization:
            return False
        user, _ = given_login(authorization)
        address = _address(scope)
        self._refuse_if_limited(address, user)
        if login_user(authorization, self.logins) is None:
            scheme = authorization.partition(" ")[0].lower()[:16]
            self.login_limiter.failed(address, user, f"{scheme} login on {scope['path'][:80]!r}")
            raise ClientError(401, "a login is required, and the one sent is not right: "
                              "Authorization: Bearer user:password (or HTTP basic auth)")
        self.login_limiter.succeeded(address, user)
        return True

    async def _check(self, scope, receive):
        if not self._host_ok(scope):
            log.warning("refused a request for Host %r", _header(scope, b"host"))
            raise ClientError(400, "this server does not answer to that Host name (only to "
                              "the names it is served under; see --allowed-host)")
        path, method = scope["path"], scope["method"]
        if self.logins and (path.startswith("/v1/") or path in DOCS_PATHS):
            # The paths that take a login from the header (gradio's own take its cookie).
            logged_in = self._check_login_header(scope)
            if path in DOCS_PATHS and not (logged_in or self._has_session(scope)):
                raise ClientError(401, "a login is required")
        content_type = _header(scope, b"content-type").split(";", 1)[0].strip().lower()
        if method == "POST" and path.startswith("/v1/") and not self.logins \
                and content_type != "application/json":
            raise ClientError(415, "the body must be sent as Content-Type: application/json")
        if method in ("POST", "PUT", "PATCH") and content_type == "application/json":
            body = await _read_body(receive)
            parse_json(body)  # raises ClientError on what cannot be parsed safely
            return _replay(body, receive)
        return receive

    def _host_ok(self, scope) -> bool:
        return self.allowed_hosts is None or \
            host_name(_header(scope, b"host")) in self.allowed_hosts

    @staticmethod
    def _has_session(scope) -> bool:
        """Whether the request carries a page session (gradio's login cookie) that is open."""
        token = _session_token(scope)
        return bool(token) and token in getattr(scope.get("app"), "tokens", {})

    def _end_sessions_of_removed_users(self, scope) -> None:
        """A page session (gradio's login cookie) of a user no longer among the logins (taken
        out of --auth-file) ends here: gradio then answers it as not logged in."""
        token = _session_token(scope)
        tokens = getattr(scope.get("app"), "tokens", None)
        user = tokens.get(token) if token and tokens is not None else None
        if user is not None and user not in self.logins.users():
            tokens.pop(token, None)
            log.info("ended a page session of user %r: no longer among the logins", user[:64])

    @staticmethod
    async def _refuse(scope, send, error: ClientError) -> None:
        if scope["path"].startswith("/v1/"):  # the OpenAI error shape
            payload = {"error": {"message": error.message, "type": error.kind,
                                 "param": error.param, "code": None}}
        else:
            payload = {"detail": error.message}
        headers = [(b"content-type", b"application/json")]
        if error.status == 401:
            headers.append((b"www-authenticate", REALM.encode()))
        if error.retry_after:
            headers.append((b"retry-after", error.retry_after.encode()))
        body = json.dumps(payload).encode()
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def request_guard(logins: Logins | None,
                  allowed_hosts: set[str] | None) -> Middleware:
    """The guard as an entry of the FastAPI app's middleware list, so that it is in place
    before the port opens: demo.launch(app_kwargs={"middleware": [request_guard(...)]}).
    allowed_hosts: the Host names answered when there are no logins (None: any)."""
    return Middleware(RequestGuard, logins=logins, allowed_hosts=allowed_hosts)


def _with_content_policy(send):
    async def send_with_policy(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()),
                                              (b"content-security-policy", CONTENT_POLICY)]}
        await send(message)

    return send_with_policy


def _session_token(scope) -> str | None:
    """The request's gradio login cookie (its session token), if it has one."""
    cookie_id = getattr(scope.get("app"), "cookie_id", None)  # gradio's App: Starlette's scope
    if cookie_id is None:
        return None
    cookies = {}
    for item in _header(scope, b"cookie").split(";"):
        name, _, value = item.strip().partition("=")
        cookies[name] = value
    return cookies.get(f"access-token-{cookie_id}") or \
        cookies.get(f"access-token-unsecure-{cookie_id}")


def _address(scope) -> str:
    return (scope.get("client") or ("?",))[0]


def _header(scope, name: bytes) -> str:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return ""


async def _read_body(receive, limit: int = MAX_JSON_BYTES) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientError(400, "the client went away before sending the body")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            size_text = f"{limit // 2**20} MB" if limit >= 2**20 else f"{limit // 1024} KB"
            raise ClientError(413, f"the body is larger than {size_text}")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # http.disconnect, when the client goes

    return replay
