"""Every import path a user reads or writes resolves: each ``jagg_lightning.X`` and ``python -m jagg_lightning...``
named in README.md, docs/*.md, configs/*.yaml and benchmarks/*.py (collected by grep, so a path a new page or preset
names is checked too), the console entry point of setup.cfg, the package root's public names and the public paths
kept by re-export modules (``jagg_lightning.strategies``: configs name it)."""

import configparser
import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["README.md", "docs/*.md", "configs/*.yaml", "configs/**/*.yaml", "benchmarks/*.py"]
DOTTED = re.compile(r"(?<![\w./-])jagg_lightning(?:\.[A-Za-z_]\w*)*")
RUN_AS_MODULE = re.compile(r"python3? -m (jagg_lightning(?:\.\w+)*)")


def documented() -> dict[str, str]:
    """Each dotted path the sources name -> the first file naming it."""
    found: dict[str, str] = {}
    for pattern in SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            for name in DOTTED.findall(path.read_text()):
                found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def resolve(path: str):
    """The module or object ``path`` names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name is not None and not name.startswith(err.name) and err.name != name:
                raise  # the module exists but needs a package this environment lacks: say so
            continue
        # this checkout's module, not another copy's (an editable install elsewhere answers an old path too)
        assert Path(obj.__file__).resolve().is_relative_to(ROOT), f"{name} is {obj.__file__}, outside {ROOT}"
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(path)


DOCUMENTED = documented()


def test_the_sources_name_paths():
    """The grep sees the documents: the paths every user meets are among what it found."""
    for name in ("jagg_lightning.callbacks.RoutingStats", "jagg_lightning.rewards.PickScoreReward",
                 "jagg_lightning.strategies.FSDP2Strategy", "jagg_lightning.testbed.evaluate", "jagg_lightning.data"):
        assert name in DOCUMENTED, name
    assert len(DOCUMENTED) > 40


@pytest.mark.parametrize("path", sorted(DOCUMENTED))
def test_each_documented_path_imports(path):
    try:
        assert resolve(path) is not None
    except (ImportError, AttributeError) as err:
        pytest.fail(f"{DOCUMENTED[path]} names {path}, which does not resolve: {err}")


def test_each_python_dash_m_runs_a_module():
    """``python -m X`` in the docs and configs names a module (or a package with ``__main__``)."""
    named = {m for pattern in SOURCES for path in ROOT.glob(pattern) for m in RUN_AS_MODULE.findall(path.read_text())}
    assert "jagg_lightning" in named and "jagg_lightning.testbed.train" in named
    for name in sorted(named):
        spec = importlib.util.find_spec(name)
        assert spec is not None and Path(spec.origin).resolve().is_relative_to(ROOT), name
        if spec.submodule_search_locations:  # a package runs its __main__
            assert importlib.util.find_spec(f"{name}.__main__") is not None, name


def test_the_console_entry_point_and_the_public_names():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    scripts = [line.split("=", 1)[1].strip() for line in cfg["options.entry_points"]["console_scripts"].splitlines()
               if "=" in line]
    assert scripts == ["jagg_lightning.cli:main"]
    module, _, func = scripts[0].partition(":")
    assert callable(getattr(importlib.import_module(module), func))
    import jagg_lightning

    for name in jagg_lightning.__all__:
        assert getattr(jagg_lightning, name).__name__ == name


def test_the_kept_re_exports_are_the_moved_classes():
    """``jagg_lightning.strategies.FSDP2Strategy`` (configs' class path) is the class itself, so a config naming the
    old path and one naming the new build the same strategy."""
    from jagg_lightning.distributed import strategies as moved
    from jagg_lightning.strategies import DDPStrategy, FSDP2Strategy

    assert FSDP2Strategy is moved.FSDP2Strategy and DDPStrategy is moved.DDPStrategy
