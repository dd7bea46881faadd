"""The layers a `unicron run` option's value comes from, read and converted with their labels.

``Resolver.get(dest)`` looks in order at the flag, the environment (``PET_*`` exactly as torchrun
reads it, ``UNICRON_*``), Slurm, the ``--config`` file and the default; the first layer that
has the option wins. Each value is converted by the option's own converter and any error
names where the bad text came from (``UNICRON_HANG_FACTOR: not a number: 'x'``,
``job.toml: nproc-per-node: ...``). ``ranks[dest]`` says which layer it was (``CLI`` ..
``DEFAULT``), ``labels[dest]`` how to name it in a message.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from unicron.errors import ConfigError, UsageError
from unicron.launch.args import BY_DEST, BY_FLAG, closest_flag
from unicron.smallfile import NotReadable, read_regular

CLI, ENV, SLURM, FILE, DEFAULT = range(5)
CONFIG_MAX_BYTES = 1 << 20  # a settings file; anything larger is a mistake
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class Resolver:
    """Finds each option's value in the layers, converting and labelling it."""

    def __init__(self, given: Mapping[str, object], spelling: Mapping[str, str], environ: Mapping[str, str],
                 slurm: Mapping[str, tuple[str, str]], file_values: Mapping[str, Any], file_path: str | None):
        self.given, self.spelling, self.environ = given, spelling, environ
        self.slurm, self.file_values, self.file_path = slurm, file_values, file_path
        self.labels: dict[str, str] = {}
        self.ranks: dict[str, int] = {}

    def get(self, dest: str) -> Any:
        value, label, rank = self._find(dest)
        self.labels[dest], self.ranks[dest] = label, rank
        return value

    def _find(self, dest: str) -> tuple[Any, str, int]:
        opt = BY_DEST[dest]
        if dest in self.given:
            label = self.spelling[dest]
            raw = self.given[dest]
            if not opt.takes_value:
                return True, label, CLI
            assert opt.convert is not None
            if opt.repeat:
                assert isinstance(raw, list)
                return tuple(_convert(opt.convert, str(r), label, UsageError) for r in raw), label, CLI
            return _convert(opt.convert, str(raw), label, UsageError), label, CLI
        for var in opt.envs:
            text = self.environ.get(var, "")
            if text.strip():  # an empty variable counts as unset
                return _from_text(opt, text, var, pet=var.startswith("PET_")), var, ENV
        if dest in self.slurm:
            text, var = self.slurm[dest]
            return _from_text(opt, text, var, pet=False), var, SLURM
        key = opt.name[2:]
        if key in self.file_values:
            label = f"{self.file_path}: {key}"
            return _from_file(opt, self.file_values[key], label), label, FILE
        if not opt.takes_value:
            return False, "default", DEFAULT
        if opt.repeat:
            return (), "default", DEFAULT
        assert opt.convert is not None
        default = opt.convert(opt.default) if isinstance(opt.default, str) else opt.default
        return default, "default", DEFAULT


def _convert(convert: Callable[[str], object], text: str, label: str, error: type[UsageError]) -> Any:
    try:
        return convert(text)
    except ValueError as err:
        raise error(f"{label}: {err}") from None


def _from_text(opt: Any, text: str, label: str, *, pet: bool) -> Any:
    if not opt.takes_value:
        if pet:  # torchrun's check_env: an integer, true when non-zero
            if not text.strip().lstrip("-").isdigit():
                raise ConfigError(f"{label}: expected an integer (1 on, 0 off); got {text!r}")
            return int(text) != 0
        if text.strip().lower() in _TRUE + _FALSE:
            return text.strip().lower() in _TRUE
        raise ConfigError(f"{label}: expected 1/0, true/false, yes/no; got {text!r}")
    if opt.repeat:
        items = [p for p in text.replace(",", ";").split(";") if p.strip()]
        if not items:  # separators only: as the flag with that value, not silently nothing
            raise ConfigError(f"{label}: no value in {text!r}")
        return tuple(_convert(opt.convert, p, label, ConfigError) for p in items)
    return _convert(opt.convert, text, label, ConfigError)


def _from_file(opt: Any, value: Any, label: str) -> Any:
    if not opt.takes_value:
        if isinstance(value, bool):
            return value
        return _from_text(opt, str(value), label, pet=False)
    if opt.repeat:
        items = value if isinstance(value, list) else [value]
        return tuple(_from_file_scalar(opt, item, label) for item in items)
    return _from_file_scalar(opt, value, label)


def _from_file_scalar(opt: Any, value: Any, label: str) -> Any:
    if isinstance(value, datetime.date | datetime.time):  # YAML and TOML read `2024-06-01` as a date
        value = value.isoformat()
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ConfigError(f"{label}: expected a string or number, got {_shown(value)}")
    return _convert(opt.convert, str(value), label, ConfigError)


def _shown(value: Any) -> str:
    """A file's value as the error shows it: JSON where it is (a list, a table), else its type
    (a YAML set or binary)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = f"a {type(value).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def load_config_file(path: str) -> dict[str, Any]:
    """Settings from a TOML, YAML or JSON file, keyed by long flag name (dashes or underscores)."""
    suffix = Path(path).suffix.lower()
    try:
        text = read_regular(path, CONFIG_MAX_BYTES).decode("utf-8")
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config file: {err.strerror or err}") from None
    except NotReadable as err:
        raise ConfigError(f"{path}: cannot read config file: it {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text (byte {err.start}); a config file is TOML, YAML or JSON") from None
    try:
        if suffix == ".toml":
            data: Any = _toml_module(path).loads(text)
        elif suffix in (".yaml", ".yml"):
            data = _load_yaml(text)
        elif suffix == ".json":
            data = json.loads(text, object_pairs_hook=_no_repeated_keys)
        else:
            raise ConfigError(f"{path}: config file must end in .toml, .yaml, .yml or .json")
    except ConfigError:
        raise
    except Exception as err:  # each parser has its own error type; all mean "not valid"
        raise ConfigError(f"{path}: not valid {suffix[1:].upper()}: {str(err).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of settings at the top level")
    settings: dict[str, Any] = {}
    for key, value in data.items():
        name = "--" + str(key).replace("_", "-")
        if name not in BY_FLAG or name == "--config":
            close = closest_flag(name) if name != "--config" else None
            hint = f" (did you mean {close[2:]}?)" if close else ""
            raise ConfigError(f"{path}: unknown setting {key!r}{hint}")
        setting = BY_FLAG[name].name[2:]
        if setting in settings:  # e.g. nproc-per-node and nproc_per_node: which one was meant?
            raise ConfigError(f"{path}: {setting} is set twice ({', '.join(repr(k) for k in data if _same(k, name))})")
        settings[setting] = value
    return settings


def _same(key: Any, flag: str) -> bool:
    name = "--" + str(key).replace("_", "-")
    return name in BY_FLAG and BY_FLAG[name] is BY_FLAG[flag]


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object, refusing a key given twice (json keeps the last one silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"{key!r} appears twice in one object")
        out[key] = value
    return out


def _load_yaml(text: str) -> Any:
    """``yaml.safe_load``, refusing a key given twice in one mapping (PyYAML keeps the last)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"{key!r} appears twice in one mapping",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    return yaml.load(text, Loader=Loader)  # noqa: S506 (a SafeLoader)


def _toml_module(path: str) -> Any:
    try:
        import tomllib  # Python 3.11+

        return tomllib
    except ImportError:
        try:
            import tomli  # the same parser, for Python 3.10

            return tomli
        except ImportError:
            raise ConfigError(f"{path}: TOML config files need Python 3.11+ or the tomli package; "
                              "use .yaml or .json") from None
