"""Subclassed models as TF2 users write them (TensorFlow Recommenders' ranking tutorial, a
subclassed Wide & Deep), their data, and the user's training loop, shared by
tests/test_subclassed.py and scripts/mpi_subclassed.py.

    >>> model = BUILDERS["tfrs_ranking"]()
    >>> batches = batches_for("tfrs_ranking", steps=2, batch=8)
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

L = tf.keras.layers
USERS, MOVIES, HOURS, K = 60, 40, 24, 8


class RankingModel(tf.keras.Model):
    """TFRS's ranking tutorial: ids -> IntegerLookup -> Embedding per side, concatenated into
    Dense 64-32-1."""

    def __init__(self):
        super().__init__()
        self.user = tf.keras.Sequential([L.IntegerLookup(vocabulary=np.arange(1, USERS)), L.Embedding(USERS + 1, K)])
        self.movie = tf.keras.Sequential([L.IntegerLookup(vocabulary=np.arange(1, MOVIES)), L.Embedding(MOVIES + 1, K)])
        self.ratings = tf.keras.Sequential([L.Dense(64, activation="relu"), L.Dense(32, activation="relu"), L.Dense(1)])

    def call(self, inputs):
        user_id, movie_id = inputs
        return self.ratings(tf.concat([self.user(user_id), self.movie(movie_id)], axis=1))


def tfrs_ranking():
    import tensorflow_recommenders as tfrs

    class MovielensModel(tfrs.models.Model):
        def __init__(self):
            super().__init__()
            self.ranking_model = RankingModel()
            self.task = tfrs.tasks.Ranking(loss=tf.keras.losses.MeanSquaredError(),
                                           metrics=[tf.keras.metrics.RootMeanSquaredError()])

        def call(self, features):
            return self.ranking_model((features["user_id"], features["movie_id"]))

        def compute_loss(self, features, training=False):
            labels = features.pop("rating")
            return self.task(labels=labels, predictions=self(features))
    return MovielensModel()


class QueryTower(tf.keras.Model):
    """TFRS's deep-retrieval tutorial style: a subclassed tower over two features, their
    embeddings concatenated into Dense 32 -> 16."""

    def __init__(self):
        super().__init__()
        self.user = tf.keras.Sequential([L.IntegerLookup(vocabulary=np.arange(1, USERS)), L.Embedding(USERS + 1, K)])
        self.hour = L.Embedding(HOURS, 4)
        self.dense = tf.keras.Sequential([L.Dense(32, activation="relu"), L.Dense(16)])

    def call(self, features):
        return self.dense(tf.concat([self.user(features["user_id"]), self.hour(features["hour"])], axis=1))


def tfrs_retrieval():
    """A two-tower retrieval model: the query tower (user_id, hour) and the candidate tower
    (movie_id -> IntegerLookup -> Embedding -> Dense 16, a Sequential) are called in
    compute_loss, not in a call(); in-batch softmax loss (tfrs.tasks.Retrieval: summed over the
    batch, about 100 here, so the tests hold it to float32 order relative to its size)."""
    import tensorflow_recommenders as tfrs

    class RetrievalModel(tfrs.models.Model):
        def __init__(self):
            super().__init__()
            self.query_model = QueryTower()
            self.candidate_model = tf.keras.Sequential([L.IntegerLookup(vocabulary=np.arange(1, MOVIES)),
                                                        L.Embedding(MOVIES + 1, K), L.Dense(16)])
            self.task = tfrs.tasks.Retrieval()

        def compute_loss(self, features, training=False):
            query = self.query_model({"user_id": features["user_id"], "hour": features["hour"]})
            return self.task(query, self.candidate_model(features["movie_id"]), compute_metrics=not training)
    return RetrievalModel()


def tfrs_dcn():
    """TFRS's DCN tutorial: per-feature IntegerLookup -> Embedding, concatenated into x0, a
    ``tfrs.layers.dcn.Cross`` layer (x0 * (W x0 + b) + x0: the product needs every field's
    columns of x0 on every process), Dense 32 -> 1, a Ranking task."""
    import tensorflow_recommenders as tfrs

    class DCN(tfrs.models.Model):
        def __init__(self):
            super().__init__()
            self.user = tf.keras.Sequential([L.IntegerLookup(vocabulary=np.arange(1, USERS)), L.Embedding(USERS + 1, K)])
            self.movie = tf.keras.Sequential([L.IntegerLookup(vocabulary=np.arange(1, MOVIES)),
                                              L.Embedding(MOVIES + 1, K)])
            self.cross = tfrs.layers.dcn.Cross(name="cross")
            self.deep = tf.keras.Sequential([L.Dense(32, activation="relu"), L.Dense(1)])
            self.task = tfrs.tasks.Ranking(loss=tf.keras.losses.MeanSquaredError())

        def call(self, features):
            x0 = tf.concat([self.user(features["user_id"]), self.movie(features["movie_id"])], axis=1)
            return self.deep(self.cross(x0))

        def compute_loss(self, features, training=False):
            labels = features.pop("rating")
            return self.task(labels=labels, predictions=self(features))
    return DCN()


class WideAndDeep(tf.keras.Model):
    """A subclassed Wide & Deep over a dict of 4 id fields: a 1-wide weight per field summed
    (wide) plus Dense 16 -> 1 over the concatenated embeddings (deep)."""
    FIELDS = ("f0", "f1", "f2", "f3")

    def __init__(self):
        super().__init__()
        self.emb = {f: L.Embedding(40, 4, name=f"emb_{f}") for f in self.FIELDS}
        self.wide = {f: L.Embedding(40, 1, name=f"wide_{f}") for f in self.FIELDS}
        self.hidden, self.out = L.Dense(16, activation="relu"), L.Dense(1)

    def call(self, x):
        wide = tf.add_n([L.Flatten()(self.wide[f](x[f])) for f in self.FIELDS])
        deep = self.out(self.hidden(tf.concat([L.Flatten()(self.emb[f](x[f])) for f in self.FIELDS], axis=-1)))
        return tf.sigmoid(wide + deep)


class ValueDependent(tf.keras.Model):
    """Python control flow on a tensor's value: cannot be traced on symbolic inputs."""

    def __init__(self):
        super().__init__()
        self.emb, self.out = L.Embedding(40, 4), L.Dense(1)

    def call(self, x):
        h = L.Flatten()(self.emb(x["f0"]))
        if tf.reduce_sum(h) > 0:
            h = h * 2.0
        return self.out(h)


BUILDERS = {"tfrs_ranking": tfrs_ranking, "subclassed_wdl": WideAndDeep, "tfrs_retrieval": tfrs_retrieval,
            "tfrs_dcn": tfrs_dcn}
EXPECTED = {"tfrs_ranking": ["embed_concat_dense"], "subclassed_wdl": ["embed_concat_dense", "lr_sum"],
            "tfrs_retrieval": ["embed_concat_dense", "embed_concat_dense"],
            "tfrs_dcn": ["field_rows", "field_rows"]}      # Cross reads x0 whole: each table by field rows
TFRS = ("tfrs_ranking", "tfrs_retrieval", "tfrs_dcn")     # fed as one dict of features, labels inside
COLLECTIVES = {"tfrs_retrieval": 2}            # allreduces per forward pass: one per tower (else 1)


def batches_for(name: str, steps: int, batch: int, seed: int = 0) -> list[dict]:
    """Batches as each model's user feeds them: TFRS features with the rating inside; (x, y) for W&D."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        if name in ("tfrs_ranking", "tfrs_dcn"):
            u, m = rng.integers(1, USERS, batch), rng.integers(1, MOVIES, batch)
            out.append({"user_id": tf.constant(u), "movie_id": tf.constant(m),
                        "rating": tf.constant(((u % 5 + m % 3) / 2).astype(np.float32))})
        elif name == "tfrs_retrieval":
            u = rng.integers(1, USERS, batch)
            out.append({"user_id": tf.constant(u), "hour": tf.constant(rng.integers(0, HOURS, batch)),
                        "movie_id": tf.constant((u * 7 + rng.integers(0, 3, batch)) % (MOVIES - 1) + 1)})
        else:
            x = {f: tf.constant(np.minimum(rng.zipf(1.4, batch), 39)) for f in WideAndDeep.FIELDS}
            score = sum(np.sin(x[f].numpy() + j) for j, f in enumerate(WideAndDeep.FIELDS))
            out.append((x, tf.constant((score > 0).astype(np.float32).reshape(-1, 1))))
    return out


def sample_of(name: str, batches: list):
    return batches[0] if name in TFRS else batches[0][0]


def outputs(name: str, model, probe) -> np.ndarray:
    """What the model computes on ``probe``: its predictions; for retrieval both towers' outputs."""
    if name == "tfrs_retrieval":
        query = model.query_model({"user_id": probe["user_id"], "hour": probe["hour"]})
        return np.concatenate([np.asarray(query), np.asarray(model.candidate_model(probe["movie_id"]))], axis=1)
    return np.asarray(model.predict_on_batch(probe))


def train(name: str, model, batches: list, probe) -> dict:
    """The user's loop: compile and fit (TFRS: its compute_loss, Adagrad 0.1; W&D: binary
    cross-entropy, Adam 0.02); predictions on ``probe`` and the last loss."""
    if name in TFRS:
        model.compile(tf.keras.optimizers.Adagrad(0.1))
        ds = tf.data.Dataset.from_tensor_slices({k: tf.concat([b[k] for b in batches], 0) for k in batches[0]})
    else:
        model.compile(tf.keras.optimizers.Adam(0.02), "binary_crossentropy")
        xs = {k: tf.concat([x[k] for x, _ in batches], 0) for k in batches[0][0]}
        ds = tf.data.Dataset.from_tensor_slices((xs, tf.concat([y for _, y in batches], 0)))
    hist = model.fit(ds.batch(int(tf.nest.flatten(batches[0])[0].shape[0])), epochs=1, verbose=0, shuffle=False)
    return {"predictions": outputs(name, model, probe), "loss": hist.history["loss"][-1]}


def probe_of(name: str):
    b = batches_for(name, 1, 16, seed=99)[0]
    return {k: v for k, v in b.items() if k != "rating"} if name in TFRS else b[0]
