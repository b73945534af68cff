"""Prompts for the equivalence tests: short questions, code, chat, repeated and non-ASCII
text, and one long (~1,000 token) prompt built from varied real-looking paragraphs."""

from __future__ import annotations

LONG_PARAGRAPHS = [
    # history
    "The Hanseatic League was a commercial and defensive confederation of merchant guilds and "
    "market towns in Central and Northern Europe. Growing from a few North German towns in the "
    "late 12th century, the league came to dominate Baltic maritime trade for three centuries. "
    "Its members shared a legal system, and its armies defended the towns against pirates and "
    "princes alike. Lübeck, Hamburg and Bergen were among its most important trading posts.",
    # science
    "Photosynthesis converts light energy into chemical energy. In the light-dependent reactions, "
    "chlorophyll absorbs photons and splits water molecules, releasing oxygen as a by-product. "
    "The energy is stored briefly in ATP and NADPH, which the Calvin cycle then uses to fix carbon "
    "dioxide into three-carbon sugars. Roughly 100 to 115 billion tonnes of carbon are turned into "
    "biomass this way every year, most of it by plankton in the oceans.",
    # code
    "Here is a small Python function that merges two sorted lists:\n\n"
    "def merge(a, b):\n"
    "    out, i, j = [], 0, 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n"
    "        else:\n"
    "            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n\n"
    "It runs in O(len(a) + len(b)) time and is the heart of merge sort.",
    # dialogue
    "\"Are you coming to the market tomorrow?\" asked Maria, wiping flour from her hands.\n"
    "\"Only if the rain stops,\" her brother replied. \"Last week the road to the valley was "
    "flooded, and the cart lost a wheel near the old mill.\"\n"
    "\"Then we leave at dawn,\" she said, \"before the clouds come over the ridge.\"",
    # recipe / list
    "Ingredients for a simple tomato soup (serves 4):\n"
    "- 1 kg ripe tomatoes, roughly chopped\n- 1 onion, diced\n- 2 cloves of garlic\n"
    "- 500 ml vegetable stock\n- 2 tablespoons olive oil\n- salt, pepper and a few basil leaves\n"
    "Sweat the onion and garlic in the oil for five minutes, add the tomatoes and stock, simmer "
    "for twenty minutes, then blend until smooth and season to taste.",
    # economics
    "Inflation measures how quickly the general level of prices rises. Central banks usually aim "
    "for about two percent a year: low enough that money keeps its value, high enough to leave "
    "room for cutting interest rates in a downturn. When inflation runs hot, a bank raises its "
    "policy rate, which makes borrowing dearer, cools spending and, with a lag of a year or more, "
    "slows price growth.",
    # technical prose
    "A transformer layer has two parts. The attention block lets every token look at earlier "
    "tokens, weighting them by the similarity of queries and keys; the feed-forward block then "
    "transforms each token on its own. During generation the keys and values of past tokens do "
    "not change, so an inference engine stores them in a cache and computes only the newest "
    "token's projections at each step.",
    # table / numbers
    "Year | Revenue (M$) | Employees\n2019 | 12.4 | 85\n2020 | 10.9 | 80\n2021 | 15.2 | 97\n"
    "2022 | 19.8 | 121\n2023 | 23.1 | 140\nRevenue grew by 86 percent over five years while the "
    "head count rose by 65 percent, so revenue per employee improved steadily.",
    # geography
    "The Danube rises in the Black Forest of Germany and flows some 2,850 kilometres to the Black "
    "Sea, passing through or along the borders of ten countries, more than any other river in the "
    "world. Vienna, Bratislava, Budapest and Belgrade all stand on its banks.",
    # astronomy
    "Jupiter is the largest planet in the Solar System, more than eleven times the diameter of "
    "Earth. Its Great Red Spot is a storm wider than our whole planet that has been observed "
    "since at least 1831. The four large moons discovered by Galileo in 1610 (Io, Europa, "
    "Ganymede and Callisto) were the first objects found to orbit another planet.",
    # email
    "Subject: Rescheduling Thursday's review\n\nHi Sam,\n\nThe design review planned for "
    "Thursday at 14:00 clashes with the vendor call, so I've moved it to Friday at 10:30 in room "
    "4B. Please bring the updated latency numbers and the memory budget for the cache; if the "
    "new figures are not ready, we can discuss the open questions instead.\n\nThanks,\nPriya",
    # closing question
    "Summarise the passages above in two sentences, then explain which of them you found most "
    "surprising and why.",
]

LONG_PROMPT = "\n\n".join(LONG_PARAGRAPHS)

MEDIUM_PROMPT = (
    "The history of computing stretches from the abacus to the modern microprocessor. Charles "
    "Babbage designed the Analytical Engine in the 1830s, and Ada Lovelace wrote what many "
    "consider the first program for it. A century later, Alan Turing formalised computation, "
    "and during the Second World War machines such as Colossus and ENIAC showed that electronic "
    "computers were practical. The transistor, invented at Bell Labs in 1947, replaced vacuum "
    "tubes, and the integrated circuit put many transistors on one chip. In the decades since, "
    "the number of transistors on a chip has doubled roughly every two years, and"
)

# name -> prompt; str prompts go through the tokenizer, dicts carry token ids.
SHORT_PROMPTS: dict[str, object] = {
    "capital": "The capital of France is",
    "question": "Why is the sky blue?",
    "math": "Solve for x: 3x + 5 = 20. Answer:",
    "code_py": 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "code_sql": "SELECT name, COUNT(*) AS orders\nFROM customers\nJOIN orders ON",
    "json": '{"name": "Alice", "age": 30, "city":',
    "html": "<!DOCTYPE html>\n<html>\n<head>\n  <title>",
    "list": "Shopping list:\n- eggs\n- milk\n-",
    "numbers": "1, 2, 3, 5, 8, 13,",
    "repeated": "the cat sat on the mat. " * 24,
    "poem": "Roses are red,\nviolets are",
    "translate": "Translate to French: Good morning, how are you? ->",
    "whitespace": "\tindented line\n\n\n    text   with   odd    spacing",
    "french": "Le café était très bon, mais l'addition",
    "japanese": "東京は日本の首都で、",
    "russian_emoji": "Привет! I love 🍕 and",
    "one_char": "a",
    "punctuation": "?!...",
    "medium": MEDIUM_PROMPT,
}
