//! Chat templates rendered the Hugging Face way.

use std::path::{Path, PathBuf};

use metrale_model_engine::chat::{ChatMessage, ChatTemplate, strftime};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn conversation() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", "Hi there"),
        ChatMessage::new("assistant", "Hello."),
        ChatMessage::new("user", "2+2?"),
    ]
}

fn special(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn fixture_chatml_template() {
    let template =
        ChatTemplate::from_tokenizer_config(fixtures().join("tokenizer/tokenizer_config.json"))
            .expect("fixture template");
    let messages = conversation();
    let body = "<|im_start|>system\nYou are terse.<|im_end|>\n\
                <|im_start|>user\nHi there<|im_end|>\n\
                <|im_start|>assistant\nHello.<|im_end|>\n\
                <|im_start|>user\n2+2?<|im_end|>\n";
    assert_eq!(template.render(&messages, false).expect("render"), body);
    assert_eq!(
        template.render(&messages, true).expect("render"),
        format!("{body}<|im_start|>assistant\n")
    );

    // The same template through a model folder.
    let from_dir =
        ChatTemplate::from_model_dir(fixtures().join("llama")).expect("model dir template");
    assert_eq!(
        from_dir.render(&messages, true).expect("render"),
        format!("{body}<|im_start|>assistant\n")
    );
}

#[test]
fn raise_exception_fails_the_render_with_its_message() {
    let source = "{% if messages[0]['role'] != 'user' %}\
                  {{ raise_exception('Conversation roles must start with user') }}\
                  {% endif %}{% for m in messages %}{{ m.content }}{% endfor %}";
    let template = ChatTemplate::new(source, Vec::new()).expect("compiles");
    let err = template
        .render(&conversation(), false)
        .expect_err("system first")
        .to_string();
    assert!(
        err.contains("Conversation roles must start with user"),
        "{err}"
    );
    let ok = template
        .render(&[ChatMessage::new("user", "fine")], false)
        .expect("user first");
    assert_eq!(ok, "fine");
}

#[test]
fn special_tokens_python_methods_and_loop_controls() {
    let source = "{{ bos_token }}\
        {% for m in messages %}\
        {% if loop.index > 3 %}{% break %}{% endif %}\
        {% if m.role == 'system' %}{% continue %}{% endif %}\
        [{{ m.role.upper() }}:{{ m.content.strip().lower() }}\
        |{{ m.content.startswith('  Hi') }}|{{ m.content.split(' ') | length }}]\
        {% endfor %}{{ eos_token }}{{ pad_token }}{{ none }}";
    let template = ChatTemplate::new(
        source,
        special(&[("bos_token", "<s>"), ("eos_token", "</s>")]),
    )
    .expect("compiles");
    let messages = vec![
        ChatMessage::new("system", "skipped"),
        ChatMessage::new("user", "  Hi THERE  "),
        ChatMessage::new("assistant", "Yes"),
        ChatMessage::new("user", "never rendered"),
    ];
    // pad_token is not set: undefined prints as nothing.
    assert_eq!(
        template.render(&messages, false).expect("render"),
        "<s>[USER:hi there|True|6][ASSISTANT:yes|False|1]</s>None"
    );
}

#[test]
fn tojson_writes_python_style_json() {
    let template = ChatTemplate::new(
        "{{ messages[0] | tojson }}|{{ {'b': [1, 2.5, none, true], 'a': '<é>'} | tojson }}|{{ [1, {'k': 'v'}] | tojson(indent=2) }}",
        Vec::new(),
    )
    .expect("compiles");
    let out = template
        .render(&[ChatMessage::new("user", "x")], false)
        .expect("render");
    assert_eq!(
        out,
        "{\"role\": \"user\", \"content\": \"x\"}|{\"b\": [1, 2.5, null, true], \"a\": \"<é>\"}|\
         [\n  1,\n  {\n    \"k\": \"v\"\n  }\n]"
    );
}

#[test]
fn trim_and_lstrip_blocks_as_transformers() {
    let source = "{% for m in messages %}\n    {% if m.role == 'user' %}\nU: {{ m.content }}\n    {% else %}\nA: {{ m.content }}\n    {% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\nA:{% endif %}";
    let template = ChatTemplate::new(source, Vec::new()).expect("compiles");
    let messages = [
        ChatMessage::new("user", "q"),
        ChatMessage::new("assistant", "a"),
    ];
    assert_eq!(
        template.render(&messages, true).expect("render"),
        "U: q\nA: a\nA:"
    );
    assert_eq!(
        template.render(&messages, false).expect("render"),
        "U: q\nA: a\n"
    );
}

#[test]
fn named_template_list_picks_default_and_missing_template_errors() {
    let dir = std::env::temp_dir().join(format!("metrale-chat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let path = dir.join("tokenizer_config.json");
    std::fs::write(
        &path,
        r#"{"eos_token": {"content": "<END>"},
            "chat_template": [
              {"name": "tool_use", "template": "tools"},
              {"name": "default", "template": "{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}"}
            ]}"#,
    )
    .expect("write");
    let template = ChatTemplate::from_tokenizer_config(&path).expect("default picked");
    assert_eq!(
        template
            .render(&[ChatMessage::new("user", "x")], false)
            .expect("render"),
        "x<END>"
    );
    let tools = ChatTemplate::from_tokenizer_config_named(&path, "tool_use").expect("named");
    assert_eq!(tools.render(&[], false).expect("render"), "tools");
    let err = ChatTemplate::from_tokenizer_config_named(&path, "nope")
        .expect_err("unknown name")
        .to_string();
    assert!(err.contains("tool_use") && err.contains("nope"), "{err}");

    std::fs::write(&path, r#"{"eos_token": "</s>"}"#).expect("write");
    let err = ChatTemplate::from_tokenizer_config(&path)
        .expect_err("no template")
        .to_string();
    assert!(
        err.contains("tokenizer_config.json") && err.contains("chat_template"),
        "{err}"
    );
    let err = ChatTemplate::from_model_dir(&dir)
        .expect_err("no template")
        .to_string();
    assert!(err.contains("no chat template"), "{err}");

    // chat_template.jinja is the fallback.
    std::fs::write(dir.join("chat_template.jinja"), "J{{ eos_token }}").expect("write");
    let template = ChatTemplate::from_model_dir(&dir).expect("jinja file");
    assert_eq!(template.render(&[], false).expect("render"), "J</s>");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn syntax_errors_are_reported() {
    let err = ChatTemplate::new("{% for m in messages %}", Vec::new())
        .expect_err("unclosed")
        .to_string();
    assert!(err.contains("chat template"), "{err}");
}

#[test]
fn strftime_formats_utc_dates() {
    assert_eq!(
        strftime("%d %b %Y %A %j %I %p", 1_721_952_000),
        "26 Jul 2024 Friday 208 12 AM"
    );
    assert_eq!(
        strftime(
            "%Y-%m-%d %H:%M:%S %a %j %B %e %y %I%p %%",
            951_825_600 + 13 * 3600 + 61
        ),
        "2000-03-01 01:01:01 Wed 061 March  1 00 01AM %"
    );
    let now = ChatTemplate::new("{{ strftime_now('%Y') }}", Vec::new()).expect("compiles");
    let year: i32 = now
        .render(&[], false)
        .expect("render")
        .parse()
        .expect("a year");
    assert!(year >= 2025);
}

#[test]
fn qwen_style_template_with_tools_namespace_and_thinking() {
    let source = r##"
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
        {%- continue %}
    {%- endif %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\n' + content | trim + '<|im_end|>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
{{- 'last user: ' ~ ns.last_user }}
"##;
    let template = ChatTemplate::new(source, Vec::new()).expect("compiles");
    let messages = vec![
        ChatMessage::new("system", "S"),
        ChatMessage::new("user", "U1"),
        ChatMessage::new("assistant", "<think>r</think>\n\nA1 "),
        ChatMessage::new("user", "U2"),
    ];
    let tools: serde_json::Value = serde_json::from_str(
        r#"[{"function": {"name": "f", "parameters": {}}, "type": "function"}]"#,
    )
    .expect("json");
    let out = template
        .render_with(
            &messages,
            true,
            &[
                ("tools", tools),
                ("enable_thinking", serde_json::Value::Bool(false)),
            ],
        )
        .expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nS\n\n# Tools\n<tools>\n\
         {\"function\": {\"name\": \"f\", \"parameters\": {}}, \"type\": \"function\"}\n\
         </tools><|im_end|>\n\
         <|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n\
         <|im_start|>user\nU2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nlast user: 3"
    );
    // Without tools or the thinking switch.
    let out = template.render_with(&messages, false, &[]).expect("render");
    assert_eq!(
        out,
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n\
         <|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nU2<|im_end|>\nlast user: 3"
    );
}

#[test]
fn a_template_that_runs_away_is_stopped() {
    // Nested loops that would run 10^12 times: an error in about a second,
    // not a hang.
    let source = "{% for a in range(10000) %}{% for b in range(10000) %}{% for c in range(10000) %}x{% endfor %}{% endfor %}{% endfor %}";
    let t = ChatTemplate::new(source, vec![]).expect("compiles");
    let start = std::time::Instant::now();
    let err = t
        .render(&conversation(), true)
        .expect_err("a runaway template fails")
        .to_string();
    assert!(err.contains("instructions"), "{err}");
    eprintln!("stopped after {:?}", start.elapsed());
    // A real conversation is far from the bound.
    let chatml = ChatTemplate::from_model_dir(fixtures().join("llama")).expect("template");
    let long: Vec<ChatMessage> = (0..2000)
        .map(|i| {
            ChatMessage::new(
                if i % 2 == 0 { "user" } else { "assistant" },
                "some words here",
            )
        })
        .collect();
    chatml.render(&long, true).expect("2000 messages render");
}
