"""How a store is named in words: a MongoDB URI told from a path, a password masked in it,
and the command-line words that name a Mongo store. Plain strings: no backend is imported, so
that the operations and the command line name stores without importing one."""

from __future__ import annotations

import shlex

__all__ = ["command_words", "is_mongo_uri", "mask_uri"]


def is_mongo_uri(target: object) -> bool:
    """Whether ``target`` is a MongoDB connection string."""
    return isinstance(target, str) and target.startswith(("mongodb://", "mongodb+srv://"))


def mask_uri(uri: str) -> str:
    """The URI with its password replaced by ``***`` (safe for logs and errors), however many
    ``@`` the password holds."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        return uri
    authority, slash, tail = rest.partition("/")
    userinfo, at, hosts = authority.rpartition("@")
    if not at or ":" not in userinfo:
        return uri
    return f"{scheme}://{userinfo.split(':', 1)[0]}:***@{hosts}{slash}{tail}"


def command_words(uri: str, collection: str, flag: str = "--collection") -> str:
    """A URI and its collection as command-line words, each quoted for the shell (a URI holds
    ``&``, a collection may hold a space): what printed commands name a Mongo store with."""
    return f"{shlex.quote(mask_uri(uri))} {flag} {shlex.quote(collection)}"
