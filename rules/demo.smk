# The embedded demo's tokenizer: a small byte-level BPE in Kimi K2.5's layout, trained on the
# bundled corpus (eagledata.demo.tokenizer). The module is an input so a change to it rebuilds.


rule demo_tokenizer:
    input:
        corpus="src/eagledata/data/corpus.txt",
        # the vendored Kimi K2.5 chat template it copies is a data file, not an import
        code=code_of("scripts/build_demo_tokenizer.py", "templates/kimi-k2.5.jinja"),
    output:
        directory(f"{RESULTS}/_assets/demo-tokenizer"),
    log:
        "logs/assets/demo_tokenizer.log",
    conda:
        "../envs/core.yaml"
    script:
        "../scripts/build_demo_tokenizer.py"
