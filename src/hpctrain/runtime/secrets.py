"""What of a string may be shown: every URL in it parsed, and its secret parts hidden by what they are,
not by the name of the key they go under.

- userinfo (`scheme://<userinfo>@host`): hidden whole, whatever characters it holds (a token alone, a
  user and a password, an escaped `@`);
- the query: every value hidden but those of a few keys that never hold one (`HARMLESS_QUERY_KEYS`:
  `sslmode=require`, `timeout=30`); the fragment hidden whole (OAuth puts tokens there);
- a webhook's path (the URL itself is the credential: Slack's `/services/T../B../<secret>`, Discord's
  `/api/webhooks/<id>/<token>`, Telegram's `/bot<token>/`): hidden whole.

Used by every record a run writes (`hpctrain.runtime.config.redact`) and by every error sentence
(`hpctrain.runtime.errors`). No torch here; standard library only.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

HIDDEN = "***"
HARMLESS_QUERY_KEYS = frozenset(
    {"sslmode", "charset", "encoding", "timeout", "connect_timeout", "region", "format", "version", "v"}
)
WEBHOOK_HOSTS = ("hooks.slack.com", "api.telegram.org", "webhook.office.com", "chat.googleapis.com")

# scheme://... up to a space or a quote: a comma or a bracket may be part of its userinfo, so it is taken
# in (what follows a URL in prose is shown as part of its path, never a secret left out)
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")


def _query(query: str) -> str:
    parts = []
    for pair in re.split(r"([&;])", query):
        if pair in ("&", ";") or "=" not in pair:
            parts.append(pair if pair in ("&", ";") or not pair else HIDDEN)
            continue
        key, _, value = pair.partition("=")
        parts.append(f"{key}={value if key.lower() in HARMLESS_QUERY_KEYS or not value else HIDDEN}")
    return "".join(parts)


def _webhook(host: str, path: str) -> bool:
    host = host.lower()
    return any(host == h or host.endswith(f".{h}") for h in WEBHOOK_HOSTS) or "hook" in path.lower()


def url(text: str) -> str:
    """One URL with its secret parts hidden (see the module docstring)."""
    try:
        parts = urlsplit(text)
    except ValueError:  # not parseable as a URL (an unbalanced bracket in the host): show nothing of it
        return f"{text.partition('://')[0]}://{HIDDEN}"
    netloc = parts.netloc
    if "@" in netloc:
        netloc = f"{HIDDEN}@{netloc.rpartition('@')[2]}"
    host = netloc.rpartition("@")[2]
    path = f"/{HIDDEN}" if parts.path not in ("", "/") and _webhook(host, parts.path) else parts.path
    query = _query(parts.query) if parts.query else ""
    fragment = HIDDEN if parts.fragment else ""
    return urlunsplit((parts.scheme, netloc, path, query, fragment))


def hide(text: str) -> str:
    """`text` with every URL in it shown by `url`."""
    return _URL.sub(lambda found: url(found.group(0)), text) if "://" in text else text
