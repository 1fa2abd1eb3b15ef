// A small Markdown renderer for model answers. Safety comes first: the whole text is HTML-escaped
// before any markup is added and only the tags written below are emitted, so nothing a model says
// can become live HTML; links are made for http(s) URLs only.
"use strict";

const AxonMarkdown = (() => {
  const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
  const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
  const RULE = /^ {0,3}([-*_])( *\1){2,} *$/;
  const QUOTE = /^ {0,3}&gt; ?(.*)$/;
  const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const HOLE = /\u0000(\d+)\u0000/g; // a span set aside while the rest is formatted

  function escapeHtml(text) {
    return text.replace(/[&<>"']/g, (c) => ESCAPES[c]);
  }

  // `*` and `_` pairs whose inside neither starts nor ends with a space; `_` only between
  // non-word characters, so snake_case stays as written.
  function emphasis(html) {
    return html
      .replace(/\*\*([^\s*](?:[^*]*[^\s*])?)\*\*/g, "<strong>$1</strong>")
      .replace(/(^|\W)__([^\s_](?:[^_]*[^\s_])?)__(?!\w)/g, "$1<strong>$2</strong>")
      .replace(/(^|[^*])\*([^\s*](?:[^*]*[^\s*])?)\*(?!\*)/g, "$1<em>$2</em>")
      .replace(/(^|\W)_([^\s_](?:[^_]*[^\s_])?)_(?!\w)/g, "$1<em>$2</em>");
  }

  // Code spans and links are set aside first so that `*`, `_` or `[` inside them stay literal.
  function inline(text) {
    const spans = [];
    const hold = (html) => `\u0000${spans.push(html) - 1}\u0000`;
    let html = text.replace(/`([^`\n]+)`/g, (_, code) => hold(`<code>${code}</code>`));
    html = html.replace(
      /\[([^\]\n]+)\]\((https?:\/\/[^\s()]+)\)/g,
      (_, label, url) =>
        hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasis(label)}</a>`),
    );
    html = emphasis(html);
    // Twice: a link label may hold a code span.
    for (let pass = 0; pass < 2; pass++) html = html.replace(HOLE, (_, i) => spans[Number(i)]);
    return html;
  }

  function fence(lines, start) {
    const open = lines[start].match(FENCE);
    if (!open) return null;
    const close = new RegExp(`^ {0,3}${open[1][0] === "`" ? "`" : "~"}{${open[1].length},}\\s*$`);
    let end = start + 1;
    while (end < lines.length && !close.test(lines[end])) end++;
    const language = open[2] ? ` class="language-${open[2]}"` : "";
    const code = lines.slice(start + 1, end).join("\n");
    // An unclosed fence (an answer still streaming) runs to the end of the text.
    return [`<pre><code${language}>${code}</code></pre>`, Math.min(end + 1, lines.length)];
  }

  function heading(lines, start) {
    const match = lines[start].match(HEADING);
    if (!match) return null;
    const level = match[1].length;
    return [`<h${level}>${inline(match[2])}</h${level}>`, start + 1];
  }

  function rule(lines, start) {
    return RULE.test(lines[start]) ? ["<hr>", start + 1] : null;
  }

  function quote(lines, start) {
    let end = start;
    while (end < lines.length && QUOTE.test(lines[end])) end++;
    if (end === start) return null;
    const inner = lines.slice(start, end).map((line) => line.match(QUOTE)[1]);
    return [`<blockquote>${blocks(inner)}</blockquote>`, end];
  }

  function listItemAt(line, indent, ordered) {
    const match = line.match(LIST_ITEM);
    const sameList = match && match[1].length === indent && /\d/.test(match[2]) === ordered;
    return sameList ? match : null;
  }

  function list(lines, start) {
    const first = lines[start].match(LIST_ITEM);
    if (!first) return null;
    const indent = first[1].length;
    const ordered = /\d/.test(first[2]);
    const items = [];
    let index = start;
    while (index < lines.length) {
      const line = lines[index];
      const item = listItemAt(line, indent, ordered);
      const leading = line.length - line.trimStart().length;
      if (item) {
        items.push({ text: item[3], rest: [], width: item[0].length - item[3].length });
      } else if (line.trim() && leading > indent) {
        const current = items[items.length - 1]; // indented: a nested block of the last item
        current.rest.push(line.slice(Math.min(leading, current.width)));
      } else if (!line.trim() && listItemAt(lines[index + 1] || "", indent, ordered)) {
        // a blank line between two items keeps one list
      } else {
        break;
      }
      index++;
    }
    const tag = ordered ? "ol" : "ul";
    const number = ordered ? parseInt(first[2], 10) : 1;
    const startAttribute = number !== 1 ? ` start="${number}"` : "";
    const body = items.map((item) => `<li>${inline(item.text)}${blocks(item.rest)}</li>`);
    return [`<${tag}${startAttribute}>${body.join("")}</${tag}>`, index];
  }

  const BLOCKS = [fence, heading, rule, quote, list];

  function paragraph(lines, start) {
    let end = start + 1;
    while (end < lines.length && lines[end].trim() && !BLOCKS.some((b) => b(lines, end))) end++;
    const text = lines.slice(start, end).map((line) => inline(line.trim()));
    return [`<p>${text.join("<br>")}</p>`, end];
  }

  // `lines` are already escaped: a block's inner lines are rendered again without escaping twice.
  function blocks(lines) {
    const html = [];
    let index = 0;
    while (index < lines.length) {
      if (!lines[index].trim()) {
        index++;
        continue;
      }
      let found = null;
      for (const block of BLOCKS) if ((found = block(lines, index))) break;
      const [markup, next] = found || paragraph(lines, index);
      html.push(markup);
      index = next;
    }
    return html.join("\n");
  }

  /** The HTML of Markdown `text`; safe to assign to innerHTML. */
  function render(text) {
    return blocks(escapeHtml(String(text).replace(/\u0000/g, "")).split(/\r?\n/));
  }

  return { render, escapeHtml };
})();
