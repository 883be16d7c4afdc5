"""Debian packages as text: fetched and unpacked (archive), their files read as documents (documents)."""
