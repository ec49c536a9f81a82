"""The files a run writes: whole or not at all, and a private one (a run's secret) its owner's alone, never written
through a file or link that someone else put at its temporary name."""

from __future__ import annotations

import os
import stat

import pytest

from fast.runtime import files


def test_a_private_file_is_its_owners_alone_and_no_temporary_file_is_left(tmp_path):
    secret = tmp_path / "run" / "membership.secret"
    files.write_text(secret, "ab" * 32, private=True)
    files.write_text(secret, "cd" * 32, private=True)  # replaced whole
    assert secret.read_text() == "cd" * 32 and stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert os.listdir(secret.parent) == ["membership.secret"]


def test_the_temporary_name_is_random_and_a_link_planted_there_is_never_written_through(tmp_path, monkeypatch):
    names = []
    real_open = os.open

    def spy(path, flags, mode=0o777):
        names.append(os.path.basename(path))
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", spy)
    for _ in range(2):
        files.write_bytes(tmp_path / "secret", b"x", private=True)
    assert len(set(names)) == 2 and all(name.startswith(".secret.tmp-") for name in names)

    # someone who guessed the name: a link to a file of the owner's, and a file of their own, both refused
    victim = tmp_path / "victim"
    victim.write_bytes(b"the owner's file")
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: "guessed")
    planted = tmp_path / f".secret.tmp-{os.getpid()}-guessed"
    for plant in (lambda: planted.symlink_to(victim), lambda: planted.write_bytes(b"theirs")):
        plant()
        with pytest.raises(files.OutputError, match=r"cannot write .*secret: File exists"):
            files.write_bytes(tmp_path / "secret", b"the new secret", private=True)
        assert victim.read_bytes() == b"the owner's file" and (tmp_path / "secret").read_bytes() == b"x"
        assert planted.is_symlink() or planted.read_bytes() == b"theirs"  # theirs, left as it was
        planted.unlink()
