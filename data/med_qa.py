"""A generated medical database and question/answer pairs for the medical QA agent (`data=med_qa`).

Layout written into ``out_dir``::

    medical.sqlite        tables drugs_info and disease
    train.parquet         id, question, answer, answer_items, query (the gold SQL), lang, db_id, template
    val.parquet, test.parquet
    _meta.json            generation parameters (used to skip regeneration)

Drug and disease names are real (Chinese names with their English names); which drug treats which disease, the
dosages, adverse reactions and so on are drawn from small pools with the seed, so the facts are synthetic and the
model cannot know them: it has to query. Questions are in Chinese and English; each answer is computed by running
its gold SQL on the database. `answer_items` holds the values the answer must mention (several for list answers).
A fact (a template asked of an entity) is asked in both languages, and both go to one split; validation and test ask
about facts training never showed, in the templates' proportions (`data.splits`, stratified by template).

Usage: ``python -m data.med_qa OUT_DIR [--seed S --n-train N --n-val M --n-test K]``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sqlite3
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from data.splits import KIND, stratified_split
from foundation.schema import number
from rewards.answer_match import AnswerMatch

GENERATOR_VERSION = 2  # 2: a test split; held-out facts stratified by template
DB_ID = "medical"
_META_FILE = "_meta.json"

# (Chinese name, English name, category)
DRUGS = [
    ("阿莫西林", "Amoxicillin", "抗生素"),
    ("头孢克肟", "Cefixime", "抗生素"),
    ("左氧氟沙星", "Levofloxacin", "抗生素"),
    ("阿奇霉素", "Azithromycin", "抗生素"),
    ("甲硝唑", "Metronidazole", "抗生素"),
    ("布洛芬", "Ibuprofen", "解热镇痛药"),
    ("对乙酰氨基酚", "Paracetamol", "解热镇痛药"),
    ("阿司匹林", "Aspirin", "解热镇痛药"),
    ("二甲双胍", "Metformin", "降糖药"),
    ("格列美脲", "Glimepiride", "降糖药"),
    ("阿卡波糖", "Acarbose", "降糖药"),
    ("硝苯地平", "Nifedipine", "降压药"),
    ("氨氯地平", "Amlodipine", "降压药"),
    ("缬沙坦", "Valsartan", "降压药"),
    ("氢氯噻嗪", "Hydrochlorothiazide", "降压药"),
    ("阿托伐他汀", "Atorvastatin", "调脂药"),
    ("辛伐他汀", "Simvastatin", "调脂药"),
    ("奥美拉唑", "Omeprazole", "消化系统用药"),
    ("多潘立酮", "Domperidone", "消化系统用药"),
    ("蒙脱石散", "Montmorillonite", "消化系统用药"),
    ("氯雷他定", "Loratadine", "抗过敏药"),
    ("西替利嗪", "Cetirizine", "抗过敏药"),
    ("沙丁胺醇", "Salbutamol", "呼吸系统用药"),
    ("布地奈德", "Budesonide", "呼吸系统用药"),
    ("奥司他韦", "Oseltamivir", "抗病毒药"),
    ("阿昔洛韦", "Acyclovir", "抗病毒药"),
]

# (Chinese name, English name, department)
DISEASES = [
    ("高血压", "Hypertension", "心内科"),
    ("糖尿病", "Diabetes", "内分泌科"),
    ("高脂血症", "Hyperlipidemia", "心内科"),
    ("肺炎", "Pneumonia", "呼吸科"),
    ("支气管哮喘", "Asthma", "呼吸科"),
    ("流行性感冒", "Influenza", "呼吸科"),
    ("胃溃疡", "Gastric ulcer", "消化科"),
    ("急性胃肠炎", "Acute gastroenteritis", "消化科"),
    ("过敏性鼻炎", "Allergic rhinitis", "耳鼻喉科"),
    ("荨麻疹", "Urticaria", "皮肤科"),
    ("带状疱疹", "Herpes zoster", "皮肤科"),
    ("尿路感染", "Urinary tract infection", "泌尿科"),
    ("偏头痛", "Migraine", "神经内科"),
    ("类风湿关节炎", "Rheumatoid arthritis", "风湿免疫科"),
]

# Which drug categories may treat a disease (the draw picks drugs from these).
CATEGORY_FOR = {
    "心内科": ["降压药", "调脂药", "解热镇痛药"],
    "内分泌科": ["降糖药"],
    "呼吸科": ["抗生素", "呼吸系统用药", "抗病毒药"],
    "消化科": ["消化系统用药", "抗生素"],
    "耳鼻喉科": ["抗过敏药"],
    "皮肤科": ["抗过敏药", "抗病毒药"],
    "泌尿科": ["抗生素"],
    "神经内科": ["解热镇痛药"],
    "风湿免疫科": ["解热镇痛药"],
}

ADVERSE = ["恶心", "呕吐", "腹泻", "头痛", "头晕", "皮疹", "乏力", "失眠", "口干", "心悸", "便秘", "肝功能异常"]
CONTRA = ["孕妇", "哺乳期妇女", "严重肝功能不全者", "严重肾功能不全者", "对本品过敏者", "儿童", "消化道出血者"]
INGREDIENT_SUFFIX = ["片", "胶囊", "缓释片", "颗粒", "注射液"]
SYMPTOMS = ["发热", "咳嗽", "头痛", "乏力", "胸闷", "腹痛", "腹泻", "皮疹", "瘙痒", "关节痛", "多饮多尿", "眩晕"]
COMPLICATIONS = ["心力衰竭", "肾功能损害", "视网膜病变", "呼吸衰竭", "脱水", "继发感染", "出血", "关节畸形", "脑卒中"]
DIAGNOSIS = ["血常规", "胸部X线", "血糖检测", "血压测量", "胃镜", "尿常规", "血脂检测", "过敏原检测", "头颅CT"]
TREATMENT = ["药物治疗", "饮食控制", "规律运动", "抗感染治疗", "对症支持治疗", "手术治疗", "物理治疗", "戒烟限酒"]


def _pick(rng: random.Random, pool: list[str], k: int) -> list[str]:
    return rng.sample(pool, k)


def _build_db(path: Path, rng: random.Random) -> None:
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE drugs_info (
            drug_id INTEGER PRIMARY KEY, name TEXT NOT NULL, english_name TEXT NOT NULL, category TEXT,
            ingredients TEXT, indications TEXT, adverse_reactions TEXT, contraindications TEXT, dosage TEXT,
            prescription_required INTEGER
        );
        CREATE TABLE disease (
            disease_id INTEGER PRIMARY KEY, name TEXT NOT NULL, english_name TEXT NOT NULL, department TEXT,
            clinical_manifestations TEXT, complications TEXT, diagnosis TEXT, treatment TEXT
        );
        """
    )
    treats: dict[str, list[str]] = {drug[0]: [] for drug in DRUGS}
    for name, _, department in DISEASES:
        candidates = [d[0] for d in DRUGS if d[2] in CATEGORY_FOR[department]]
        for drug in _pick(rng, candidates, min(len(candidates), rng.randint(1, 3))):
            treats[drug].append(name)
    for i, (name, english, category) in enumerate(DRUGS, start=1):
        indications = treats[name] or [rng.choice(DISEASES)[0]]
        amount = rng.choice([0.1, 0.25, 0.5, 1, 2, 5, 10, 20])
        conn.execute(
            "INSERT INTO drugs_info VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                i,
                name,
                english,
                category,
                f"{name}{rng.choice(INGREDIENT_SUFFIX)}，每单位含{name}{amount}g",
                "、".join(indications),
                "、".join(_pick(rng, ADVERSE, rng.randint(2, 4))),
                "、".join(_pick(rng, CONTRA, rng.randint(1, 3))),
                f"口服，一次{amount}g，一日{rng.randint(1, 4)}次",
                rng.randint(0, 1),
            ),
        )
    for i, (name, english, department) in enumerate(DISEASES, start=1):
        conn.execute(
            "INSERT INTO disease VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                i,
                name,
                english,
                department,
                "、".join(_pick(rng, SYMPTOMS, rng.randint(2, 4))),
                "、".join(_pick(rng, COMPLICATIONS, rng.randint(1, 3))),
                "、".join(_pick(rng, DIAGNOSIS, rng.randint(1, 3))),
                "、".join(_pick(rng, TREATMENT, rng.randint(2, 3))),
            ),
        )
    conn.commit()
    conn.close()


def _q(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


@dataclass(frozen=True)
class _Template:
    """A question about one entity (`about`: drug or disease) in both languages, and its gold SQL."""

    name: str
    about: str
    zh: str
    en: str
    sql: Callable[[str, str], str]  # (name column, name) -> SQL: a Chinese question names `name`, an English one
    # `english_name`


def _drug_field(column: str, zh: str, en: str) -> _Template:
    return _Template(column, "drug", zh, en, lambda key, n: f"SELECT {column} FROM drugs_info WHERE {key} = {_q(n)}")


def _disease_field(column: str, zh: str, en: str) -> _Template:
    return _Template(column, "disease", zh, en, lambda key, n: f"SELECT {column} FROM disease WHERE {key} = {_q(n)}")


def _drugs_for(key: str, name: str) -> str:
    # Indications hold Chinese disease names: an English question finds the Chinese name first.
    disease = _q(name) if key == "name" else f"(SELECT name FROM disease WHERE english_name = {_q(name)})"
    return f"SELECT name FROM drugs_info WHERE indications LIKE '%' || {disease} || '%' ORDER BY drug_id"


TEMPLATES = [
    _drug_field("dosage", "{zh}的用法用量是什么？", "What is the dosage of {en}?"),
    _drug_field("adverse_reactions", "{zh}有哪些不良反应？", "What are the adverse reactions of {en}?"),
    _drug_field("contraindications", "哪些人禁用{zh}？", "Who must not take {en}?"),
    _drug_field("indications", "{zh}的适应症是什么？", "What is {en} indicated for?"),
    _drug_field("category", "{zh}属于哪一类药物？", "Which drug category does {en} belong to?"),
    _disease_field("clinical_manifestations", "{zh}有哪些临床表现？", "What are the clinical manifestations of {en}?"),
    _disease_field("complications", "{zh}有哪些并发症？", "What are the complications of {en}?"),
    _disease_field("diagnosis", "{zh}需要做哪些检查来诊断？", "Which tests diagnose {en}?"),
    _disease_field("treatment", "{zh}怎么治疗？", "How is {en} treated?"),
    _disease_field("department", "{zh}应该看哪个科室？", "Which department treats {en}?"),
    _Template(
        "drugs_for",
        "disease",
        "哪些药物可以治疗{zh}？",
        "Which drugs are indicated for {en}?",
        _drugs_for,
    ),
    _Template(
        "count_category",
        "drug",
        "数据库中与{zh}同类的药物共有多少种？",
        "How many drugs in the database are in the same category as {en}?",
        lambda key, n: (
            f"SELECT COUNT(*) FROM drugs_info WHERE category = (SELECT category FROM drugs_info WHERE {key} = {_q(n)})"
        ),
    ),
]


def _answer(conn: sqlite3.Connection, sql: str) -> tuple[str, list[str]]:
    values = [str(v) for row in conn.execute(sql).fetchall() for v in row]
    items = [item for value in values for item in value.split("、")] if len(values) == 1 else values
    return "、".join(values), items


def _facts(db_path: Path) -> list[list[dict[str, Any]]]:
    """One entry per (template, entity): its question in Chinese and in English."""
    conn = sqlite3.connect(db_path)
    try:
        facts = []
        for template in TEMPLATES:
            entities = DRUGS if template.about == "drug" else DISEASES
            for zh_name, en_name, _ in entities:
                questions = []
                for lang, text, key, name in (
                    ("zh", template.zh, "name", zh_name),
                    ("en", template.en, "english_name", en_name),
                ):
                    sql = template.sql(key, name)
                    answer, items = _answer(conn, sql)
                    questions.append(
                        {
                            "question": text.format(zh=zh_name, en=en_name),
                            "answer": answer,
                            "answer_items": items,
                            "query": sql,
                            "lang": lang,
                            "db_id": DB_ID,
                            "template": template.name,
                        }
                    )
                if questions[0]["answer_items"]:
                    facts.append(questions)
        return facts
    finally:
        conn.close()


def _params(seed: int, n_train: int, n_val: int, n_test: int) -> dict[str, int]:
    return {"version": GENERATOR_VERSION, "seed": seed, "n_train": n_train, "n_val": n_val, "n_test": n_test}


def _template(fact: list[dict[str, Any]]) -> str:
    return str(fact[0]["template"])


def generate(out_dir: str | Path, *, seed: int = 0, n_train: int = 320, n_val: int = 60, n_test: int = 60) -> Path:
    """Write the database and the splits into `out_dir` (skipped when it already holds the same parameters).

    There is one question per (template, entity, language), 480 in all.
    Written into a temporary directory first and moved into place, so a concurrent reader never sees half a set.
    """
    out = Path(out_dir)
    params = _params(seed, n_train, n_val, n_test)
    meta = out / _META_FILE
    if meta.is_file() and json.loads(meta.read_text(encoding="utf-8")) == params:
        return out
    rng = random.Random(seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        staging = Path(tmp) / "med_qa"
        staging.mkdir()
        _build_db(staging / f"{DB_ID}.sqlite", rng)
        facts = _facts(staging / f"{DB_ID}.sqlite")
        # Both languages of a fact go to the same split, so validation and test ask about facts training never
        # showed; each split holds the templates in proportion (one more fact than asked, for the rounding).
        n_val_facts, n_test_facts = (n_val + 1) // 2 + 1, (n_test + 1) // 2 + 1
        share = min((n_val_facts + n_test_facts) / len(facts), 0.99)
        held, train_facts = stratified_split(facts, share, seed, "held-out", _template)
        val_share = n_val_facts / (n_val_facts + n_test_facts)
        val_facts, test_facts = stratified_split(held, val_share, seed, "val", _template)
        val = [q for fact in val_facts for q in fact][:n_val]
        test = [q for fact in test_facts for q in fact][:n_test]
        train = [q for fact in train_facts for q in fact]
        if len(val) < n_val or len(test) < n_test or len(train) < n_train:
            raise ValueError(
                f"data.generate asks for {n_train} train, {n_val} val and {n_test} test questions; "
                f"{2 * len(facts)} exist"
            )
        rng.shuffle(train)
        for split, records in (("train", train[:n_train]), ("val", val), ("test", test)):
            frame = pd.DataFrame([{"id": f"{split}-{i}", **r} for i, r in enumerate(records)])
            frame.to_parquet(staging / f"{split}.parquet", index=False)
        (staging / _META_FILE).write_text(json.dumps(params), encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    return out


def load_split(data_dir: str | Path, split: str) -> list[dict[str, Any]]:
    """Tasks of one split (`train`, `val` or `test`): the parquet's columns plus `db_path` and `kind` (template and
    language)."""
    root = Path(data_dir)
    path = root / f"{split}.parquet"
    if not path.is_file():
        raise FileNotFoundError(f"no {split} split in {root}: looked for {path.name}")
    tasks = pd.read_parquet(path).to_dict(orient="records")
    for task in tasks:
        task["answer_items"] = [str(item) for item in task["answer_items"]]
        task["db_path"] = str(root / f"{task['db_id']}.sqlite")
        task[KIND] = f"{task['template']}|{task['lang']}"
    return tasks


@dataclass
class MedQAData:
    """Medical QA tasks from `data_dir` (generated there first when `generate` is set)."""

    task_kind: ClassVar[str] = "med_qa"

    name: str
    data_dir: str
    generate: dict[str, int] | None  # data/med_qa.py's generate() arguments; None: the parquet files are in data_dir
    train_split: str = "train"
    val_split: str = "val"
    test_split: str | None = "test"  # None: no test split
    split_seed: int = number(0, ge=0)  # the seed of every split of the training tasks (between phases)
    val_limit: int | None = number(None, gt=0)  # validate on the first N tasks (None: all)

    def __post_init__(self) -> None:
        if self.generate is None and not Path(self.data_dir).is_dir():
            raise FileNotFoundError(f"data.data_dir={self.data_dir} does not exist")

    def prepare(self) -> Path:
        if self.generate is not None:
            generate(self.data_dir, **self.generate)
        return Path(self.data_dir)

    def missing_files(self, splits: Iterable[str]) -> list[str]:
        """The parquet files of the phases `splits` (train, val, test) that `data_dir` lacks, one line each; nothing
        for a generated set (written on first use)."""
        if self.generate is not None:
            return []
        files = {"train": self.train_split, "val": self.val_split, "test": self.test_split}
        return [
            f"data.data_dir={self.data_dir} holds no {split} split: data.{split}_split={files[split]} looks for "
            f"{files[split]}.parquet"
            for split in splits
            if files.get(split) and not (Path(self.data_dir) / f"{files[split]}.parquet").is_file()
        ]

    def metric(self) -> AnswerMatch:
        """The answer mentions every value the gold SQL returned."""
        return AnswerMatch()

    def train_tasks(self) -> list[dict[str, Any]]:
        return load_split(self.prepare(), self.train_split)

    def val_tasks(self) -> list[dict[str, Any]]:
        tasks = load_split(self.prepare(), self.val_split)
        return tasks[: self.val_limit] if self.val_limit else tasks

    def test_tasks(self) -> list[dict[str, Any]]:
        return load_split(self.prepare(), self.test_split) if self.test_split else []


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n-train", type=int, default=320)
    parser.add_argument("--n-val", type=int, default=60)
    parser.add_argument("--n-test", type=int, default=60)
    args = parser.parse_args(argv)
    print(generate(args.out_dir, seed=args.seed, n_train=args.n_train, n_val=args.n_val, n_test=args.n_test))


if __name__ == "__main__":
    main()
