import fastdata
from fastdata import errors


def test_all_is_sorted_and_resolves() -> None:
    assert fastdata.__all__ == sorted(fastdata.__all__)
    for name in fastdata.__all__:
        assert getattr(fastdata, name) is not None


def test_every_error_derives_from_fastdata_error() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.FastdataError)
