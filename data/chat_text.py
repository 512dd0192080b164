"""The text that data/chat_prompts.py builds chat prompts from: slot values, templates per kind,
invented passages and follow-up turns, all written for this project (none taken from MT-bench
or Spec-Bench). Values of one slot must stay distinct after chat_prompts.normalize(); a
change here changes the prompts, so bump chat_prompts.CHAT_DATA_VERSION with it."""


# --- Slot values, written for this project. Values of one slot must stay distinct after normalize(). ---

STEM_TOPICS = [
    "photosynthesis", "plate tectonics", "the immune system", "black holes", "vaccines", "the water cycle",
    "DNA replication", "antibiotic resistance", "magnetism", "static electricity", "rainbows", "earthquakes",
    "hurricanes", "ocean tides", "the greenhouse effect", "nuclear fission", "solar panels", "wind turbines",
    "lithium-ion batteries", "the human heart", "the nervous system", "sleep cycles", "fermentation",
    "the periodic table", "chemical bonds", "acids and bases", "evolution by natural selection", "cell division",
    "the speed of light", "gravity", "friction", "sound waves", "radio waves", "GPS satellites", "encryption",
    "machine learning", "neural networks", "search engines", "compilers", "databases", "the internet",
    "transistors", "microwave ovens", "refrigerators", "jet engines", "bridges", "skyscraper foundations",
    "3D printing", "glaciers", "volcanoes", "coral reefs", "bird migration", "bee colonies", "octopus camouflage",
    "mushrooms and fungi", "soil erosion", "groundwater", "the ozone layer", "comets", "the phases of the Moon",
    "exoplanets", "the Big Bang", "entropy", "probability", "prime numbers", "the Fibonacci sequence",
    "compound interest", "statistics and averages", "blood types", "allergies", "the digestive system",
    "muscle growth", "caffeine", "the placebo effect", "memory formation", "color vision", "lasers",
    "superconductors", "electric motors", "recycling plastic", "desalination", "carbon capture",
]
HUMANITIES_TOPICS = [
    "the printing press", "the Silk Road", "the Roman Republic", "ancient Egyptian writing", "the Renaissance",
    "the Industrial Revolution", "the French Revolution", "the invention of writing", "the spread of coffee houses",
    "medieval guilds", "the history of money", "public libraries", "the first universities", "impressionist painting",
    "jazz", "classical music", "folk tales", "Greek mythology", "Stoic philosophy", "utilitarian ethics",
    "the social contract", "democracy in Athens", "the history of maps", "the age of sail", "the railway boom",
    "the history of photography", "early cinema", "the rise of the novel", "Shakespeare's comedies",
    "haiku poetry", "the Harlem Renaissance", "the history of chess", "the Olympic Games", "the Great Wall",
    "the Inca road system", "Viking trade routes", "the Ottoman Empire", "the Meiji era", "the Cold War space race",
    "the history of vaccination campaigns", "the abolition of slavery", "women's suffrage", "the labor movement",
    "the history of the calendar", "the origin of alphabets", "museums", "architecture of cathedrals",
    "street art", "the history of board games", "minimalism", "existentialism", "the idea of progress",
    "free will", "the ethics of lying", "the meaning of friendship", "nostalgia", "urbanization",
    "the history of tea", "the spice trade", "translation of literature", "oral storytelling traditions",
]
EVERYDAY_TOPICS = [
    "sourdough baking", "urban gardening", "composting", "marathon training", "yoga", "meditation",
    "learning a second language", "personal budgeting", "saving for retirement", "job interviews", "public speaking",
    "time management", "remote work", "moving to a new city", "budget travel", "camping", "first aid",
    "dog training", "caring for houseplants", "woodworking", "pottery", "knitting", "photography", "podcasting",
    "video editing", "home workouts", "meal planning", "vegetarian cooking", "making coffee at home",
    "buying a used car", "renting a first apartment", "negotiating a salary", "starting a small business",
    "writing a resume", "studying for exams", "decluttering a home", "reducing screen time", "learning guitar",
    "birdwatching", "cycling to work", "hosting a dinner party", "planning a wedding", "raising chickens",
    "keeping a journal", "running a book club", "volunteering", "online privacy", "password security",
    "spreadsheets", "choosing a laptop", "learning to swim", "rock climbing", "chess", "hiking safely",
    "reducing food waste", "saving energy at home", "making friends as an adult", "giving feedback at work",
]
WRITING_SUBJECTS = [
    "a lighthouse keeper", "a rainy afternoon", "an old clock", "a lost umbrella", "a small bookshop",
    "a community festival", "the first snow", "a night train", "a forgotten letter", "a stray cat",
    "a grandmother's kitchen", "a robot learning to paint", "the last day of summer", "a busy harbor",
    "a city at dawn", "a mountain village", "a broken violin", "a garden in winter", "a moving day",
    "an unexpected friendship", "a power cut", "a message in a bottle", "a crowded market",
    "a quiet library", "a storm at sea", "a bakery at 5 a.m.", "a school reunion", "a lost dog finding home",
    "a map with a missing corner", "a time traveler's first coffee", "the smell of rain",
    "a bicycle with a story", "a desert at night", "a retired astronaut", "a street musician",
    "a hot air balloon", "a snowed-in cabin", "a talking parrot", "a first day at work", "an empty stadium",
]
AUDIENCES = [
    "a ten-year-old", "a high-school student", "a busy manager", "a retired engineer", "a complete beginner",
    "a first-year university student", "a curious grandparent", "a non-native English speaker", "a journalist",
    "a software developer", "a nurse", "a small-business owner",
]
STYLES = ["cheerful", "formal", "humorous", "melancholy", "suspenseful", "whimsical", "nostalgic", "hopeful",
          "dramatic", "matter-of-fact"]
WORDS = ["50", "80", "100", "120", "150", "200", "250"]
COUNTS = ["three", "four", "five", "six", "seven"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Dutch", "Swedish", "Polish"]
CODE_LANGUAGES = ["Python", "JavaScript", "Java", "Go", "Rust", "C++", "TypeScript", "Ruby"]
CODE_TASKS = [
    "reverses a string", "counts the vowels in a sentence", "checks whether a number is prime",
    "returns the largest item of a list", "removes duplicates from a list while keeping order",
    "converts Celsius to Fahrenheit", "sums the digits of an integer", "checks if a word is a palindrome",
    "merges two sorted lists", "counts how often each word appears in a text", "computes a factorial",
    "finds the second smallest number in a list", "capitalizes the first letter of every word",
    "validates a simple email address", "flattens a nested list", "computes the average of a list of numbers",
    "rotates a list by k positions", "checks whether two strings are anagrams", "converts a Roman numeral to an integer",
    "finds the longest word in a sentence", "groups a list of words by their first letter",
    "computes the n-th Fibonacci number iteratively", "parses a date written as YYYY-MM-DD",
    "returns the running total of a list", "finds all pairs in a list that sum to a target",
    "checks whether brackets in a string are balanced", "converts a number to binary",
    "implements binary search on a sorted list", "counts the lines in a text file",
    "removes punctuation from a string", "transposes a matrix", "computes the median of a list",
]
NAMES = ["Amara", "Ben", "Chloe", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kavya", "Liam",
         "Maya", "Nikolai", "Olu", "Priya", "Quentin", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wen", "Yusuf"]
TOWNS = ["Brelford", "Calloway Bay", "Dunmere", "Eastwick Falls", "Fernhollow", "Glenrock", "Harrow Point",
         "Ivybridge Vale", "Juniper Creek", "Kestrel Ridge", "Larkmoor", "Millbrook Harbor", "Northfen",
         "Oakhaven", "Pinecrest Landing", "Quarry Hill"]
COMPANIES = ["Brightleaf Tools", "Cobalt Kettle Co.", "Driftwood Analytics", "Ember & Oak Furniture",
             "Fjordline Travel", "Greenpath Bikes", "Harbor Lantern Foods", "Ironbark Software",
             "Juniper Lane Books", "Kitewing Drones", "Lumen Loom Textiles", "Moss & Stone Garden Supply"]
ITEMS = ["notebooks", "apples", "tickets", "bags of flour", "plant pots", "marbles", "stickers", "bottles of juice"]
SENTENCES = [
    "The library opens at nine o'clock on weekdays.", "Could you tell me where the train station is?",
    "My brother is learning to play the piano.", "We are planning a picnic by the river this weekend.",
    "The soup needs a little more salt.", "I forgot my umbrella at the office.",
    "Please send me the report before Friday.", "The museum is free on the first Sunday of the month.",
    "Our neighbors adopted a very small dog.", "It has been raining since yesterday morning.",
    "I would like a table for four, please.", "The meeting has been moved to next Tuesday.",
    "She walks to work when the weather is nice.", "This bread was baked this morning.",
    "How much does a ticket to the concert cost?", "The children built a snowman in the garden.",
    "I have never seen such a beautiful sunset.", "The shop on the corner sells fresh flowers.",
    "Remember to turn off the lights when you leave.", "He is reading a book about ancient Rome.",
    "The bus was late again this morning.", "We need two more chairs for the party.",
    "My favorite season is autumn because of the colors.", "The hotel room has a view of the mountains.",
    "Can I pay by card or only in cash?", "The new bridge will open next spring.",
]
PHRASES = ["good luck with your exam", "where is the nearest pharmacy", "I am allergic to peanuts",
           "the check, please", "nice to meet you", "what time does the store close", "happy birthday",
           "I am lost", "how was your weekend", "see you tomorrow", "could you speak more slowly",
           "I would like to book a room"]
COMPARISONS = [
    "tea and coffee", "trains and planes for a 500 km trip", "renting and buying a home", "paper books and e-readers",
    "cats and dogs as pets", "running and swimming for fitness", "solar and wind power", "Python and JavaScript",
    "city life and country life", "working from home and working in an office", "cash and card payments",
    "public and private schools", "electric cars and hybrid cars", "learning alone and learning in a group",
    "board games and video games", "gas stoves and induction cooktops", "fiction and non-fiction reading",
    "SQL and NoSQL databases", "laptops and desktop computers", "a gap year and going straight to university",
]
SCENARIOS = [
    "a town bans cars from its center", "a school moves to a four-day week", "a company lets staff choose their hours",
    "a city plants a tree on every street", "a country makes public transport free",
    "a library starts lending tools", "a supermarket removes all plastic packaging",
    "a village gets fast internet for the first time", "a team replaces meetings with written updates",
    "a family stops using their car for a month", "a restaurant lets customers pay what they want",
    "a museum stays open all night once a month", "a park adds a community vegetable garden",
]
ROLES = ["a tour guide", "a ship's captain", "a museum curator", "a detective", "a medieval blacksmith",
         "a weather forecaster", "a sports commentator", "a librarian", "a chef on a cooking show",
         "a park ranger", "a time traveler from the year 2300", "a friendly robot", "a job interviewer",
         "a travel agent", "a fitness coach", "a customer support agent"]
SITUATIONS = ["greeting a group of new visitors", "explaining a surprising discovery",
              "calming someone who is nervous", "announcing some unexpected news",
              "giving directions to a lost traveler", "describing an ordinary day at work",
              "answering a child's endless questions", "persuading someone to try something new"]


SLOTS = {
    "stem": STEM_TOPICS, "topic": HUMANITIES_TOPICS, "task": EVERYDAY_TOPICS, "subject": WRITING_SUBJECTS,
    "audience": AUDIENCES, "style": STYLES, "words": WORDS, "count": COUNTS, "lang": LANGUAGES,
    "code_lang": CODE_LANGUAGES, "code_task": CODE_TASKS, "name": NAMES, "other": NAMES, "town": TOWNS,
    "company": COMPANIES, "items": ITEMS, "sentence": SENTENCES, "phrase": PHRASES, "pair": COMPARISONS,
    "scenario": SCENARIOS, "role": ROLES, "situation": SITUATIONS,
    "a": [str(n) for n in range(3, 60)], "b": [str(n) for n in range(2, 25)], "c": [str(n) for n in range(60, 400, 7)],
    "pct": [str(n) for n in (5, 10, 12, 15, 20, 25, 30, 40, 50, 75)], "year": [str(y) for y in range(1952, 2021, 3)],
    "year_next": [str(y) for y in range(2025, 2031)],
    "year_next_past": [str(y) for y in range(2019, 2025)],
}

# Passages for summarization, extraction and retrieval-augmented answering: invented facts.
PASSAGES = [
    "{company}, a firm based in {town}, reported that its sales grew by {pct} percent last year. The chief "
    "executive, {name}, said the growth came mostly from new customers abroad, while costs rose because of higher "
    "shipping prices. The company plans to hire {a} more people and open a second office in {year_next}.",
    "The town council of {town} voted on Monday to turn the old railway line into a {a}-kilometre walking and "
    "cycling path. Supporters, led by local teacher {name}, argued it would bring visitors and safer routes to "
    "school; opponents worried about the cost and about parking near the entrances. Work starts next spring.",
    "In {year}, {name} opened a small bakery in {town} with a single oven. Today it employs {b} people and sells "
    "about {c} loaves a day. {name} credits the success to a sourdough starter shared by a neighbor and to "
    "staying open early for shift workers, though rising flour prices have squeezed profits this year.",
    "A survey of {c} residents of {town} found that {pct} percent would use a weekly farmers' market if it were held "
    "on Saturdays. Most respondents wanted local vegetables and bread; fewer were interested in prepared food. "
    "The organizer, {name}, hopes to launch a trial market with {b} stalls in {year_next}.",
    "Meeting notes: {name} presented the plan for the {company} website redesign. The team agreed to finish the "
    "new product pages by week {b}, to test the checkout with {a} customers, and to postpone the mobile app. "
    "{other} will collect feedback and report back at the next meeting.",
    "{name} reviewed the {company} model {a} kettle after using it for {b} weeks. It boils water quickly and looks "
    "good on the counter, but the lid is stiff and the handle gets warm. At its price, {name} thinks it is a fair "
    "choice for a small kitchen, though not for a large family.",
    "Volunteers in {town} counted {c} birds of {b} species during this year's winter count, led by {name}. "
    "Sparrows were the most common; two species seen in {year} were missing. The group blames the loss of hedges "
    "and asks residents to leave part of their gardens wild.",
    "{company} is recalling {c} bicycle lights sold since {year_next_past} because the battery cover can come loose. "
    "No injuries have been reported. Customers can return the lights to any shop for a full refund or a free "
    "replacement; a spokesperson, {name}, apologised for the trouble.",
    "The {town} youth orchestra, founded by {name} in {year}, will play its first concert abroad next month. Its {a} "
    "members, aged 12 to 18, raised the travel money themselves through bake sales and a sponsored walk of "
    "{b} kilometres. The program mixes folk songs with a new piece by a local composer.",
    "Email from {name} to the team: the office in {town} will close for {b} days next month while the heating is "
    "replaced. Everyone should work from home during that time, take their laptops home before Friday and book "
    "meeting rooms at the {company} building if they need to meet in person.",
    "Researchers at the {town} institute followed {c} adults for {b} years and found that those who walked at "
    "least {a} minutes a day slept better and reported less stress. The lead author, {name}, cautions that the "
    "study shows a link, not a cause, and that people who walk may differ in other ways.",
    "Recipe note from {name}: for {b} pancakes, mix {a}0 grams of flour, two eggs and a cup of milk, rest the batter "
    "for ten minutes, then cook each pancake until bubbles appear. {name} adds a pinch of cinnamon and serves them "
    "with fruit; the recipe came from a cafe in {town} that closed in {year}.",
]
RAG_QUESTIONS = [
    ["How much did sales grow?", "Who is the chief executive?", "Why did costs rise?"],
    ["How long will the path be?", "Who led the supporters?", "What were the opponents worried about?"],
    ["When was the bakery opened?", "How many loaves does it sell a day?", "What has squeezed profits?"],
    ["How many residents were surveyed?", "On which day should the market be held?", "How many stalls are planned?"],
    ["What did the team postpone?", "Who will collect feedback?", "By which week should the product pages be done?"],
    ["How long was the kettle used?", "What are its weak points?", "Who is it a fair choice for?"],
    ["How many birds were counted?", "Which birds were the most common?", "What does the group ask residents?"],
    ["Why are the lights recalled?", "What can customers do?", "Were there any injuries?"],
    ["Who founded the orchestra?", "How did the members raise money?", "What will the program include?"],
    ["Why will the office close?", "What should everyone do before Friday?", "Where can people meet?"],
    ["How long were the adults followed?", "What did the walkers report?", "What does the lead author caution?"],
    ["What spice does the note add?", "How long should the batter rest?", "Where did the recipe come from?"],
]


# Templates per kind; slots are SLOTS' names ({passage} and {question}: PASSAGES, RAG_QUESTIONS).
TEMPLATES = {
    "writing": [
        "Write a short {style} poem about {subject}.",
        "Write a {words}-word story about {subject}, in a {style} tone.",
        "Write a haiku about {subject}.",
        "Write a limerick about {subject}.",
        "Write the opening paragraph of a {style} novel that begins with {subject}.",
        "Write a diary entry of about {words} words from someone who encounters {subject}.",
        "Write a friendly email inviting a colleague to a talk about {task}.",
        "Draft a {words}-word blog post introduction about {task} for {audience}.",
        "Write a product description of about {words} words for a beginner's kit for {task}.",
        "Write a short speech, in a {style} tone, opening a local festival about {topic}.",
        "Write a {style} song chorus about {subject}.",
        "Write a letter to {audience} encouraging them to try {task}.",
    ],
    "roleplay": [
        "Pretend you are {role}. You are {situation}. What do you say?",
        "Act as {role} and introduce {audience} to {task}.",
        "You are {role} speaking to {audience}. Stay in character and explain {stem}.",
        "Imagine you are {role} giving a short talk on {topic}. Begin the talk.",
        "Play the part of {role}. I am {audience} and I have just asked you about {subject}. Answer me in character.",
        "Let's role-play: you are {role} and I am a visitor. Start the conversation by {situation}.",
    ],
    "reasoning": [
        "What are the pros and cons of {task}?",
        "Compare {pair}: how are they alike and how do they differ?",
        "Suppose {scenario}. What are {count} likely consequences, good or bad?",
        "Give {count} arguments for and {count} against this idea: {scenario}.",
        "What could go wrong when someone starts {task}, and how can they avoid it?",
        "If {stem} stopped working as we understand it tomorrow, what would change in everyday life?",
        "Which is the better choice for {audience}: {pair}? Reason it through before you answer.",
        "A friend claims that {task} is a waste of time. How would you reason with them?",
    ],
    "math": [
        "What is {a} multiplied by {b}? Show your working.",
        "Solve for x: {a}x + {b} = {c}.",
        "What is {pct} percent of {c}?",
        "A rectangle is {a} cm wide and {b} cm long. What are its area and perimeter?",
        "Find the greatest common divisor of {a} and {c}.",
        "What is the sum of all whole numbers from 1 to {c}?",
        "Convert {c} minutes into hours and minutes.",
        "A circle has a radius of {b} cm. What are its circumference and area?",
        "What is the average of {a}, {b} and {c}?",
        "Simplify the fraction {a}/{c} as far as possible.",
    ],
    "math_reasoning": [
        "{name} buys {a} {items} at {b} dollars each and pays with a {c}-dollar budget. How much is left?",
        "A train travels {c} kilometres in {b} hours. What is its average speed, and how far would it go in {a} hours?",
        "{name} saves {a} dollars every week. How many weeks until {name} has {c} dollars?",
        "A shop sells {items} for {b} dollars each, with {pct} percent off if you buy more than {a}. "
        "What do {c} of them cost?",
        "{name} reads {a} pages a day. The book has {c} pages. After {b} days, how many pages are left?",
        "A class of {a} students shares {c} {items} equally. How many does each get, and how many are left over?",
        "{name} and {other} split a bill of {c} dollars; {name} pays {pct} percent of it. How much does each pay?",
        "A tank holds {c} litres and fills at {b} litres a minute. How long until it is full if it starts empty?",
    ],
    "coding": [
        "Write a {code_lang} function that {code_task}.",
        "Explain, step by step, how you would write a {code_lang} program that {code_task}.",
        "Write a {code_lang} function that {code_task}, with comments and two example calls.",
        "What is a simple way to test a {code_lang} function that {code_task}?",
        "Write a {code_lang} function that {code_task}, and state its time complexity.",
        "I am {audience}. Show me how a function that {code_task} works in {code_lang}, line by line.",
    ],
    "extraction": [
        "Extract every person, place and organisation named in this text, as a JSON list:\n\n{passage}",
        "List all the numbers in the text below and say what each one measures.\n\n{passage}",
        "Turn the following text into a table with the columns fact and value.\n\n{passage}",
        "From the text below, extract the main claim and the evidence given for it.\n\n{passage}",
        "Give {count} keywords for {stem}, each with a one-line definition.",
        "Make a bulleted checklist of the steps someone needs to start {task}.",
    ],
    "stem": [
        "Explain {stem} to {audience}.",
        "How does {stem} work? Keep it under {words} words.",
        "What is the science behind {stem}?",
        "What are {count} common misconceptions about {stem}?",
        "Describe {stem} in three short paragraphs for {audience}.",
        "What everyday example best illustrates {stem}, and why?",
        "What experiment could {audience} do at home to see {stem} in action?",
    ],
    "humanities": [
        "Summarize the history of {topic} in {count} sentences.",
        "Why does {topic} still matter today?",
        "How did {topic} change the lives of ordinary people?",
        "What can {topic} teach us about human nature?",
        "Explain {topic} to {audience} in under {words} words.",
        "What are {count} questions historians still debate about {topic}?",
        "Write a short essay plan about {topic} with an introduction, {count} points and a conclusion.",
    ],
    "translation": [
        "Translate into {lang}: {sentence}",
        "How would you say this in {lang}? \"{sentence}\"",
        "Translate the following sentence into {lang} and explain any tricky words: {sentence}",
        "How do you say \"{phrase}\" in {lang}, and how is it pronounced?",
        "Give a formal and an informal {lang} version of: {sentence}",
    ],
    "summarization": [
        "Summarize this in {count} bullet points:\n\n{passage}",
        "Give a one-sentence summary of the following text.\n\n{passage}",
        "Summarize the text below for {audience}.\n\n{passage}",
        "Write a headline and a short summary for this news item:\n\n{passage}",
        "What are the key points of this passage? Be brief.\n\n{passage}",
    ],
    "qa": [
        "What is {stem}?",
        "Who were the key figures in {topic}?",
        "When did {topic} begin, and why?",
        "Is {task} hard to learn?",
        "What is the most important thing to know about {stem}?",
        "Where can I learn more about {topic}?",
        "How long does it take to get good at {task}?",
        "Why do people care about {topic}?",
        "What tools do I need for {task}?",
        "What are {count} facts about {stem} that most people get wrong?",
        "How is {stem} measured or observed?",
        "What did {topic} replace, and what replaced it?",
    ],
    "rag": [
        "Answer the question using only the context below.\n\nContext: {passage}\n\nQuestion: {question}",
        "Read the passage and answer: {question}\n\nPassage: {passage}",
        "Based on this document, {question_lower} If the document does not say, answer 'not stated'.\n\n{passage}",
    ],
    "advice": [
        "Give me {count} practical tips for getting started with {task}.",
        "I want to learn {task} in a month. Make me a simple weekly plan.",
        "What questions should a beginner ask before getting into {task}?",
        "I am {audience} and I want to try {task}. Where should I start?",
        "What is a realistic budget for {task}, and where can I save money?",
        "How can I stay motivated with {task} when progress feels slow?",
    ],
}

# Follow-ups that depend on the first reply, per kind (a second turn), and generic third turns.
FOLLOW_UPS = {
    "writing": ["Make it shorter.", "Now give it a title.", "Rewrite it in a more formal tone.",
                "Make the ending happier.", "Rewrite it for children.", "Turn it into a short poem."],
    "roleplay": ["Stay in character and tell me more.", "What happens next?", "Now answer a skeptical visitor.",
                 "Drop the character and explain what you just described."],
    "reasoning": ["Which argument do you find strongest, and why?", "What evidence would change your mind?",
                  "Summarize your reasoning in two sentences.", "Now argue the opposite side."],
    "math": ["Check your answer by another method.", "Explain each step more simply.",
             "What if the numbers were doubled?", "Write the solution as a short Python program."],
    "math_reasoning": ["Explain each step more simply.", "How would the answer change if the first number were halved?",
                       "Check your answer in a different way.", "Write it as a single equation."],
    "coding": ["Now give an example in Python.", "Add error handling to it.", "Write three unit tests for it.",
               "Can you make it faster?", "Explain the code line by line.", "Rewrite it without any loops."],
    "extraction": ["Now give the result as a Markdown table.", "Sort the items alphabetically.",
                   "Which item is the most important?", "Return it as YAML instead."],
    "stem": ["Explain the second point in more detail.", "Give me a real-world example.",
             "Can you say that more simply?", "What is still unknown about this?"],
    "humanities": ["Explain the second point in more detail.", "Who disagrees with this view?",
                   "How does this compare with today?", "Recommend a book on it."],
    "translation": ["Now translate it back into English, word for word.", "Give another way to say it.",
                    "Is that version polite enough for a stranger?", "Explain the grammar of your translation."],
    "summarization": ["Make it even shorter.", "What detail did you leave out?", "Rewrite the summary for a child.",
                      "Give the summary a title."],
    "qa": ["Can you give a concrete example?", "Why is that?", "Tell me one surprising fact about it.",
           "Say that in one sentence."],
    "rag": ["Quote the sentence your answer comes from.", "What else does the text say about it?",
            "Answer again in one word if you can."],
    "advice": ["Make it shorter.", "Which tip matters most?", "What if I only have ten minutes a day?",
               "Turn that into a checklist."],
}
THIRD_TURNS = ["Thanks! Can you sum up our whole conversation in two sentences?", "Now make it shorter.",
               "Could you put that in a bulleted list?", "What is one common mistake to avoid here?",
               "Explain that as if I were twelve.", "Great. What should I read next?",
               "Give me one more example.", "Rewrite your last answer in a friendlier tone."]
