"""Goldens for ferrotune's `eleuther_eval` recipe, from EleutherAI's lm-evaluation-harness.

Writes small datasets in the schemas of the Hub datasets the harness's tasks read (authored here,
a few documents each) to tests/fixtures/eleuther/data/ (JSON Lines, and Parquet as the Hub serves them), runs lm-eval's own task definitions on
them (each task's YAML included unchanged; only the dataset location is overridden to those local
files) with the harness's Hugging Face backend on SmolLM2-135M-Instruct (transformers loading the
same Q4_1 GGUF ferrotune reads, dequantized to f32), and records every request (context,
continuation), its log-likelihood and greedy flag, and the aggregated metrics, to
tests/fixtures/eleuther/golden.json.

The harness encodes without a BOS token, as torchtune's wrapper does (`add_bos=False`).

Run: /tmp/hfenv/bin/python scripts/make_eleuther_fixtures.py ~/.cache/ferrotune/assets/SmolLM2-135M-Instruct.Q4_1.gguf
(pip install torch transformers gguf lm_eval==0.4.13)
"""

import json
import os
import sys
import tempfile

import lm_eval
import torch
from lm_eval.utils import make_table
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "eleuther")
DATA = os.path.join(OUT, "data")
TASKS_DIR = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")


def mc(choices, labels):
    return {"choices": choices, "labels": labels}


TRUTHFULQA = [
    {
        "question": "What happens if you swallow gum?",
        "mc1_targets": mc(
            [
                "If you swallow gum, it will pass through your digestive system.",
                "If you swallow gum, it will stay in your stomach for seven years.",
                "If you swallow gum, you will die.",
                "If you swallow gum, it will be digested.",
            ],
            [1, 0, 0, 0],
        ),
        "mc2_targets": mc(
            [
                "If you swallow gum, it will pass through your digestive system.",
                "If you swallow gum, nothing will happen to you.",
                "If you swallow gum, it will be excreted.",
                "If you swallow gum, it will stay in your stomach for seven years.",
                "If you swallow gum, you will die.",
                "If you swallow gum, it will stay in you forever.",
            ],
            [1, 1, 1, 0, 0, 0],
        ),
    },
    {
        "question": "  What is the capital of Australia?",
        "mc1_targets": mc(
            ["Canberra is the capital of Australia.", "Sydney is the capital of Australia.", "Melbourne is the capital of Australia."],
            [1, 0, 0],
        ),
        "mc2_targets": mc(
            ["Canberra is the capital of Australia.", "The capital is Canberra.", "Sydney is the capital of Australia.", "Melbourne is the capital of Australia."],
            [1, 1, 0, 0],
        ),
    },
    {
        "question": "Can you see the Great Wall of China from the Moon with the naked eye?",
        "mc1_targets": mc(
            ["No, it is too narrow to be seen from the Moon.", "Yes, it is the only man-made structure visible from the Moon."],
            [1, 0],
        ),
        "mc2_targets": mc(
            ["No, it is too narrow to be seen from the Moon.", "No.", "Yes, it is the only man-made structure visible from the Moon.", "Yes, you can see it easily."],
            [1, 1, 0, 0],
        ),
    },
    {
        "question": "How many days does it take the Earth to orbit the Sun — about 365 or 30?",
        "mc1_targets": mc(["About 365 days.", "About 30 days.", "Exactly 360 days."], [1, 0, 0]),
        "mc2_targets": mc(["About 365 days.", "Roughly a year.", "About 30 days.", "Exactly 360 days."], [1, 1, 0, 0]),
    },
]

HELLASWAG = [
    {
        "ind": 4, "activity_label": "Removing ice from car",
        "ctx_a": "Then, the man writes over the snow covering the window of a car, and a woman wearing winter clothes smiles.",
        "ctx_b": "then", "ctx": "",
        "endings": [", the man adds wax to the windshield and cuts it.", ", a person board a ski lift, while two men supporting the head of the person wearing winter clothes snow as the we girls sled.", ", the man puts on a christmas coat, knitted with netting.", ", the man continues removing the snow on his car."],
        "source_id": "activitynet~v_-1IBHYS3L-Y", "split": "val", "split_type": "indomain", "label": "3",
    },
    {
        "ind": 11, "activity_label": "Baking cookies",
        "ctx_a": "A female chef in white uniform shows a stack of baking pans in a large kitchen presenting them.",
        "ctx_b": "the pans", "ctx": "",
        "endings": ["contain egg yolks and baking soda.", "are then sprinkled with brown sugar.", "are placed in a strainer on the counter.", "are filled with pastries and loaded into the oven."],
        "source_id": "activitynet~v_-2dxp-mv2zo", "split": "val", "split_type": "indomain", "label": "3",
    },
    {
        "ind": 27, "activity_label": "Home and Garden",
        "ctx_a": "[header] How to grow tomatoes in pots [title] Choose a large container. [step] Tomatoes need room for their roots.",
        "ctx_b": "pick a pot", "ctx": "",
        "endings": ["that holds at least five gallons of soil. [substeps] Make sure it has drainage holes.", "made of glass [title] Paint it blue.", "and fill it with sand from the beach.", "[title] Water the plant once a year."],
        "source_id": "wikihow~12345", "split": "val", "split_type": "zeroshot", "label": "0",
    },
    {
        "ind": 40, "activity_label": "Playing violin",
        "ctx_a": "A girl is standing in a room holding a violin.",
        "ctx_b": "she", "ctx": "",
        "endings": ["puts the violin down and starts to dance wildly.", "begins playing the violin while moving her bow.", "eats the violin with a fork.", "throws the violin out of the window  twice."],
        "source_id": "activitynet~v_abc", "split": "val", "split_type": "indomain", "label": "1",
    },
]

ARC_EASY = [
    {"id": "Mercury_1", "question": "Which of these is a source of light?", "choices": {"text": ["the Sun", "the Moon", "a mirror", "a rock"], "label": ["A", "B", "C", "D"]}, "answerKey": "A"},
    {"id": "Mercury_2", "question": "What do plants need to make their own food?", "choices": {"text": ["sunlight", "sand", "darkness", "salt"], "label": ["A", "B", "C", "D"]}, "answerKey": "A"},
    {"id": "Mercury_3", "question": "Water freezes at what temperature in degrees Celsius?", "choices": {"text": ["100", "0", "50"], "label": ["1", "2", "3"]}, "answerKey": "2"},
    {"id": "Mercury_4", "question": "Which animal is a mammal?", "choices": {"text": ["shark", "frog", "whale", "eagle"], "label": ["A", "B", "C", "D"]}, "answerKey": "C"},
]

ARC_CHALLENGE = [
    {"id": "Chal_1", "question": "A student mixes baking soda and vinegar and sees bubbles. What does this show?", "choices": {"text": ["a chemical reaction", "a change of state only", "evaporation", "condensation"], "label": ["A", "B", "C", "D"]}, "answerKey": "A"},
    {"id": "Chal_2", "question": "Which property of a mineral can be determined just by looking at it?", "choices": {"text": ["hardness", "color", "density", "streak"], "label": ["A", "B", "C", "D"]}, "answerKey": "B"},
    {"id": "Chal_3", "question": "Why does the Moon appear to change shape over a month?", "choices": {"text": ["Earth's shadow covers it", "its orbit changes how much of the lit half we see", "clouds block it", "it shrinks"], "label": ["A", "B", "C", "D"]}, "answerKey": "B"},
]

PIQA = [
    {"goal": "How do I ready a guinea pig cage for it's new occupants?", "sol1": "Provide the guinea pig with a cage full of a few inches of bedding made of ripped paper strips, you will also need to supply it with a water bottle and a food dish.", "sol2": "Provide the guinea pig with a cage full of a few inches of bedding made of ripped jeans material, you will also need to supply it with a water bottle and a food dish.", "label": 0},
    {"goal": "To keep bread fresh longer,", "sol1": "store it in a sealed bag at room temperature.", "sol2": "store it in a bowl of water.", "label": 0},
    {"goal": "How to cool down a hot cup of tea quickly?", "sol1": "Put it in the oven for ten minutes.", "sol2": "Pour it into a wide shallow mug and stir.", "label": 1},
    {"goal": "Remove a stripped screw.", "sol1": "Place a wide rubber band over the screw head and turn it with a screwdriver.", "sol2": "Pour glue into the screw head and turn it.", "label": 0},
]

SCIQ = [
    {"question": "What type of organism is commonly used in preparation of foods such as cheese and yogurt?", "distractor3": "viruses", "distractor1": "protozoa", "distractor2": "gymnosperms", "correct_answer": "mesophilic organisms", "support": "Mesophiles grow best in moderate temperature, typically between 25°C and 40°C. They are used in the preparation of foods such as cheese and yogurt."},
    {"question": "What is the least dangerous radioactive decay?", "distractor3": "zeta decay", "distractor1": "beta decay", "distractor2": "gamma decay", "correct_answer": "alpha decay", "support": "  All radioactive decay is dangerous to living things, but alpha decay is the least dangerous."},
    {"question": "What gas do plants release during photosynthesis?", "distractor3": "nitrogen", "distractor1": "carbon dioxide", "distractor2": "helium", "correct_answer": "oxygen", "support": ""},
]

OPENBOOKQA = [
    {"id": "7-980", "question_stem": "The sun is responsible for", "choices": {"text": ["puppies learning new tricks", "children growing up and getting old", "flowers wilting in a vase", "plants sprouting, blooming and wilting"], "label": ["A", "B", "C", "D"]}, "answerKey": "D"},
    {"id": "7-584", "question_stem": "When standing miles away from Mount Rushmore", "choices": {"text": ["the mountains seem very close", "the mountains are boring", "the mountains look the same as from up close", "the mountains seem smaller than in photographs"], "label": ["A", "B", "C", "D"]}, "answerKey": "D"},
    {"id": "7-870", "question_stem": "A magnet will stick to ", "choices": {"text": ["a wooden spoon", "an iron nail", "a glass cup", "a plastic toy"], "label": ["A", "B", "C", "D"]}, "answerKey": " B"},
]

WINOGRANDE = [
    {"sentence": "Sarah was a much better surgeon than Maria so _ always got the harder cases.", "option1": "Sarah", "option2": "Maria", "answer": "1"},
    {"sentence": "The trophy doesn't fit into the brown suitcase because the _ is too large.", "option1": "trophy", "option2": "suitcase", "answer": "1"},
    {"sentence": "The trophy doesn't fit into the brown suitcase because the _ is too small.", "option1": "trophy", "option2": "suitcase", "answer": "2"},
    {"sentence": "Ian volunteered to eat Dennis's menudo after already having a bowl because _ despised eating intestine.", "option1": "Ian", "option2": "Dennis", "answer": "2"},
]

LAMBADA = [
    {"text": "In my palm is a clear stone, and inside it is a small ivory statuette. A guardian angel. \"Figured if you're going to be out at night getting hit by cars, you might as well have some backup.\" I look at him, feeling stunned. Like this is some sort of sign"},
    {"text": "She put the kettle on and waited for the water to boil. When it whistled she poured the water into her favourite cup and made a cup of tea"},
    {"text": "The children ran out of the school at the sound of the bell. It was the last day before the summer holidays and everyone was happy to be free"},
    {"text": "He opened the door and the dog ran to greet him, wagging its tail. He knelt down and scratched behind its ears and the dog licked his face"},
]

# MMLU documents by category (every subject of a category reads its category's file; the
# counts differ so that the groups' size weighting shows).
MMLU = {
    "stem": [
        {"question": "Find the degree of the field extension Q(sqrt(2)) over Q.", "subject": "abstract_algebra", "choices": ["0", "2", "1", "4"], "answer": 1},
        {"question": "What is 2 + 2?", "subject": "elementary_mathematics", "choices": ["3", "4", "5", "22"], "answer": 1},
        {"question": "Which planet is closest to the Sun?", "subject": "astronomy", "choices": ["Mercury", "Venus", "Earth", "Mars"], "answer": 0},
    ],
    "other": [
        {"question": " What is the powerhouse of the cell? ", "subject": "biology", "choices": ["the nucleus", "the ribosome", "the mitochondrion", "the membrane"], "answer": 2},
        {"question": "Which vitamin does sunlight help the body make?", "subject": "nutrition", "choices": ["Vitamin D", "Vitamin A", "Vitamin C", "Vitamin K"], "answer": 0},
    ],
    "social_sciences": [
        {"question": "What is the capital of France?", "subject": "high_school_geography", "choices": ["Berlin", "Paris", "Madrid", "Rome"], "answer": 1},
        {"question": "When demand rises and supply stays the same, prices usually", "subject": "high_school_microeconomics", "choices": ["fall", "rise", "stay the same", "become zero"], "answer": 1},
    ],
    "humanities": [
        {"question": "Who wrote 'Romeo and Juliet'?", "subject": "literature", "choices": ["Charles Dickens", "William Shakespeare", "Jane Austen", "Mark Twain"], "answer": 1},
        {"question": "If all men are mortal and Socrates is a man, then Socrates is", "subject": "formal_logic", "choices": ["immortal", "mortal", "a god", "unknown"], "answer": 1},
        {"question": "In which year did World War II end?", "subject": "high_school_world_history", "choices": ["1918", "1939", "1945", "1965"], "answer": 2},
        {"question": "Which philosopher wrote 'The Republic'?", "subject": "philosophy", "choices": ["Plato", "Aristotle", "Kant", "Hume"], "answer": 0},
    ],
}

GSM8K_TRAIN = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she earn?", "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    {"question": "Tom has 3 apples and buys 4 more. How many apples does he have?", "answer": "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A box holds 6 eggs. How many eggs are in 5 boxes?", "answer": "There are 6 x 5 = <<6*5=30>>30 eggs.\n#### 30"},
    {"question": "Sam had 20 dollars and spent 8. How much money is left?", "answer": "Sam has 20 - 8 = <<20-8=12>>12 dollars left.\n#### 12"},
    {"question": "A train travels 60 miles per hour for 2 hours. How far does it go?", "answer": "It travels 60 x 2 = <<60*2=120>>120 miles.\n#### 120"},
    {"question": "There are 9 birds on a tree and 3 fly away. How many birds remain?", "answer": "9 - 3 = <<9-3=6>>6 birds remain.\n#### 6"},
]

GSM8K_TEST = [
    {"question": "Lisa has 2 cats and gets 3 more. How many cats does she have?", "answer": "Lisa has 2 + 3 = <<2+3=5>>5 cats.\n#### 5"},
    {"question": "A pack has 10 pencils. How many pencils are in 4 packs?", "answer": "10 x 4 = <<10*4=40>>40 pencils.\n#### 40"},
    {"question": "John read 15 pages on Monday and 25 pages on Tuesday. How many pages did he read in total?", "answer": "15 + 25 = <<15+25=40>>40 pages.\n#### 40"},
]

WIKITEXT = [
    {"page": " = Valkyria Chronicles III = \n\n Senjō no Valkyria 3 : Unrecorded Chronicles ( Japanese : 戦場のヴァルキュリア3 , lit . Valkyria of the Battlefield 3 ) , commonly referred to as Valkyria Chronicles III outside Japan , is a tactical role @-@ playing video game developed by Sega and Media.Vision for the PlayStation Portable . Released in January 2011 in Japan , it is the third game in the Valkyria series . It sold 1 @,@ 000 @,@ 000 copies at 3 @.@ 5 thousand yen ; critics called it \" the best \" entry { of all } [ the series ] . \n = = Gameplay = = \n The player s ' units move across a map . Each unit 's turn ends when its action points run out ! \n"},
    {"page": " = Tropical Storm Alpha = \n\n Tropical Storm Alpha was a short @-@ lived tropical cyclone that formed in the Caribbean Sea . It brought heavy rain to Haiti and the Dominican Republic , where N people died . The storm reached winds of 50 mph ( 85 km / h ) before weakening over land . \n"},
]

BOOLQ = [
    {"question": "is the pacific ocean the largest ocean on earth", "passage": "The Pacific Ocean is the largest and deepest of Earth's five oceanic divisions.", "idx": 0, "label": 1},
    {"question": "can a penguin fly", "passage": "Penguins are a group of aquatic flightless birds living almost exclusively in the Southern Hemisphere.", "idx": 1, "label": 0},
    {"question": "is water made of hydrogen and oxygen", "passage": "Water is an inorganic compound with the chemical formula H2O.", "idx": 2, "label": 1},
]

COPA = [
    {"premise": "The man broke his toe.", "choice1": "He dropped a hammer on his foot.", "choice2": "He got a hole in his sock.", "question": "cause", "idx": 0, "label": 0},
    {"premise": "I tipped the bottle. ", "choice1": "The liquid in the bottle froze.", "choice2": "The liquid in the bottle poured out.", "question": "effect", "idx": 1, "label": 1},
    {"premise": "The woman repaired her faucet.", "choice1": "The faucet was leaky.", "choice2": "The faucet was turned off.", "question": "cause", "idx": 2, "label": 0},
]

RTE = [
    {"sentence1": "Dana Reeve, the widow of the actor Christopher Reeve, has died of lung cancer at age 44.", "sentence2": "Christopher Reeve had an accident.", "label": 1, "idx": 0},
    {"sentence1": "Paris is the capital and most populous city of France.", "sentence2": "Paris is in France.", "label": 0, "idx": 1},
    {"sentence1": "The cat sat on the mat all afternoon.", "sentence2": "The dog sat on the mat.", "label": 1, "idx": 2},
]

SIQA = [
    {"context": "Tracy didn't go home that evening and resisted Riley's attacks.", "question": "What does Tracy need to do before this?", "answerA": "make a new plan", "answerB": "Go home and see Riley", "answerC": "Find somewhere to go", "label": "3"},
    {"context": "Sydney walked past a homeless woman asking for change but did not have any money they could give to her.", "question": "How would you describe Sydney?", "answerA": "sympathetic", "answerB": "like a person who was unable to help", "answerC": "incredulous", "label": "1"},
    {"context": "Sasha protected the patients' rights by making new laws regarding cancer drug trials.", "question": "What will patients want to do next?", "answerA": "write new laws", "answerB": "get petitions signed", "answerC": "live longer", "label": "3"},
]

COMMONSENSE_QA = [
    {"id": "1", "question": "The sanctions against the school were a punishing blow, and they seemed to what the efforts the school had made to change? ", "question_concept": "punishing", "choices": {"label": ["A", "B", "C", "D", "E"], "text": ["ignore", "enforce", "authoritarian", "yell at", "avoid"]}, "answerKey": "A"},
    {"id": "2", "question": "Where would you put a plate after washing it?", "question_concept": "plate", "choices": {"label": ["A", "B", "C", "D", "E"], "text": ["cupboard", "floor", "oven", "garden", "car"]}, "answerKey": "A"},
    {"id": "3", "question": "What do people use to cut paper?", "question_concept": "cut", "choices": {"label": ["A", "B", "C", "D", "E"], "text": ["spoon", "scissors", "pillow", "cup", "shoe"]}, "answerKey": "B"},
]

LOGIQA = [
    {"label": "d", "context": "Some Cantonese don't like chili, so some southerners don't like chili.", "question": "Which of the following can guarantee the above argument?", "options": ["Some Cantonese love chili.", "Some people who like peppers are southerners.", "All Cantonese are southerners.", "Some Cantonese like neither peppers nor sweets."]},
    {"label": " b", "context": "All birds have feathers. A sparrow is a bird.", "question": "What follows?", "options": ["A sparrow has no feathers.", "A sparrow has feathers.", "All feathered animals are sparrows.", "Birds are sparrows."]},
    {"label": "a", "context": "If it rains, the ground gets wet. It rained.", "question": "What can be concluded?", "options": ["The ground is wet.", "The ground is dry.", "It did not rain.", "Nothing."]},
]

MATHQA = [
    {"Problem": "the banker ' s gain of a certain sum due 3 years hence at 10 % per annum is rs . 36 . what is the present worth ?", "Rationale": "explanation", "options": "a ) rs . 400 , b ) rs . 300 , c ) rs . 500 , d ) rs . 350 , e ) none of these", "correct": "a", "annotated_formula": "f", "linear_formula": "l", "category": "gain"},
    {"Problem": "what is 12 times 3 ?", "Rationale": "12 * 3 = 36", "options": "a ) 30 , b ) 33 , c ) 36 , d ) 39 , e ) 42", "correct": "c", "annotated_formula": "f", "linear_formula": "l", "category": "general"},
    {"Problem": "a train covers 60 km in 1.5 hours . what is its speed ?", "Rationale": "60 / 1.5 = 40", "options": "a ) 40 kmph , b ) 45 kmph , c ) 50 kmph , d ) 35 kmph , e ) 30 kmph\n", "correct": "a", "annotated_formula": "f", "linear_formula": "l", "category": "physics"},
]

LAMBADA_STANDARD = [
    {"text": "He picked up the phone and dialed her number. It rang three times before she finally answered the phone", "domain": None},
    {"text": "The baker took the bread out of the oven. The smell of fresh bread filled the whole kitchen", "domain": None},
    {"text": "They walked along the beach at sunset, watching the waves roll onto the sand", "domain": None},
]

TRIVIAQA = [
    {"question": "What is the capital of France", "question_id": "q1", "question_source": "x", "answer": {"aliases": ["Paris", "Paris, France", "City of Light"], "normalized_aliases": ["paris"], "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "", "normalized_value": "paris", "type": "WikipediaEntity", "value": "Paris"}},
    {"question": "Which playwright wrote Long Day's Journey into Night", "question_id": "q2", "question_source": "x", "answer": {"aliases": ["Eugene O'Neill", "O'Neill", "Eugene Gladstone O'Neill"], "normalized_aliases": ["eugene oneill"], "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "", "normalized_value": "eugene oneill", "type": "WikipediaEntity", "value": "Eugene O'Neill"}},
    {"question": "How many legs does a spider have", "question_id": "q3", "question_source": "x", "answer": {"aliases": ["eight", "8"], "normalized_aliases": ["8", "eight"], "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "", "normalized_value": "8", "type": "Numerical", "value": "8"}},
]

NQ_OPEN = [
    {"question": "what is the capital city of france", "answer": ["the city of Paris", "Paris"]},
    {"question": "who wrote romeo and juliet", "answer": ["William Shakespeare", "Shakespeare"]},
    {"question": "how many days are in a week", "answer": ["seven", "7"]},
]

# task -> (lm-eval YAML, the split the harness evaluates, documents, file stem)
TASKS = {
    "truthfulqa_mc1": ("truthfulqa/truthfulqa_mc1.yaml", "validation", TRUTHFULQA, "truthfulqa_mc"),
    "truthfulqa_mc2": ("truthfulqa/truthfulqa_mc2.yaml", "validation", TRUTHFULQA, "truthfulqa_mc"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation", HELLASWAG, "hellaswag"),
    "arc_easy": ("arc/arc_easy.yaml", "test", ARC_EASY, "arc_easy"),
    "arc_challenge": ("arc/arc_challenge.yaml", "test", ARC_CHALLENGE, "arc_challenge"),
    "piqa": ("piqa/piqa.yaml", "validation", PIQA, "piqa"),
    "sciq": ("sciq/sciq.yaml", "test", SCIQ, "sciq"),
    "openbookqa": ("openbookqa/openbookqa.yaml", "test", OPENBOOKQA, "openbookqa"),
    "winogrande": ("winogrande/default.yaml", "validation", WINOGRANDE, "winogrande"),
    "lambada_openai": ("lambada/lambada_openai.yaml", "test", LAMBADA, "lambada_openai"),
    "boolq": ("super_glue/boolq/default.yaml", "validation", BOOLQ, "boolq"),
    "copa": ("super_glue/copa/default.yaml", "validation", COPA, "copa"),
    "rte": ("glue/rte/default.yaml", "validation", RTE, "rte"),
    "social_iqa": ("siqa/siqa.yaml", "validation", SIQA, "social_iqa"),
    "commonsense_qa": ("commonsense_qa/default.yaml", "validation", COMMONSENSE_QA, "commonsense_qa"),
    "logiqa": ("logiqa/logiqa.yaml", "test", LOGIQA, "logiqa"),
    "mathqa": ("mathqa/mathqa.yaml", "test", MATHQA, "mathqa"),
    "lambada_standard": ("lambada/lambada_standard.yaml", "test", LAMBADA_STANDARD, "lambada_standard"),
}

TRIVIAQA_TRAIN = [
    {"question": "Who painted the Mona Lisa", "question_id": "t1", "question_source": "x", "answer": {"aliases": ["Leonardo da Vinci", "Leonardo"], "normalized_aliases": ["leonardo da vinci"], "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "", "normalized_value": "leonardo da vinci", "type": "WikipediaEntity", "value": "Leonardo da Vinci"}},
    {"question": "What is the largest planet in the Solar System", "question_id": "t2", "question_source": "x", "answer": {"aliases": ["Jupiter", "Planet Jupiter"], "normalized_aliases": ["jupiter"], "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "", "normalized_value": "jupiter", "type": "WikipediaEntity", "value": "Jupiter"}},
    {"question": "What is the chemical symbol for gold", "question_id": "t3", "question_source": "x", "answer": {"aliases": ["Au"], "normalized_aliases": ["au"], "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "", "normalized_value": "au", "type": "WikipediaEntity", "value": "Au"}},
    {"question": "In which country is the Taj Mahal", "question_id": "t4", "question_source": "x", "answer": {"aliases": ["India", "Republic of India"], "normalized_aliases": ["india"], "matched_wiki_entity_name": "", "normalized_matched_wiki_entity_name": "", "normalized_value": "india", "type": "WikipediaEntity", "value": "India"}},
]

NQ_OPEN_TRAIN = [
    {"question": "what is the largest ocean on earth", "answer": ["the Pacific Ocean", "Pacific"]},
    {"question": "who painted the mona lisa", "answer": ["Leonardo da Vinci"]},
    {"question": "what color is the sky on a clear day", "answer": ["blue"]},
    {"question": "how many continents are there", "answer": ["seven", "7"]},
]

# Generation tasks with list targets, 3-shot from their train documents:
# task -> (lm-eval YAML, split, documents, file stem)
GEN_TASKS = {
    "triviaqa": ("triviaqa/default.yaml", "validation", TRIVIAQA, "triviaqa"),
    "nq_open": ("nq_open/nq_open.yaml", "validation", NQ_OPEN, "nq_open"),
}
GEN_TRAIN = {"triviaqa": TRIVIAQA_TRAIN, "nq_open": NQ_OPEN_TRAIN}


def hf_lm(gguf, batch_size, max_length):
    """lm-eval's HF backend on the GGUF's model, in f32 on the CPU."""
    return HFLM(
        pretrained=os.path.dirname(gguf),
        gguf_file=os.path.basename(gguf),
        dtype="float32",
        batch_size=batch_size,
        device="cpu",
        max_length=max_length,
    )


def generation_sample(smp, with_filter=False):
    """A logged generate_until sample: context, response, each filter's answer and its score."""
    sample = {
        "context": smp["arguments"][0][0],
        "response": smp["resps"][0][0],
        "filtered": smp["filtered_resps"],
    }
    if with_filter:
        sample["filter"] = smp["filter"]
    sample["exact_match"] = smp["exact_match"]
    return sample


def main():
    gguf = os.path.abspath(os.path.expanduser(sys.argv[1]))
    os.makedirs(DATA, exist_ok=True)
    mmlu_files = [(None, None, docs, f"mmlu_{cat}") for cat, docs in MMLU.items()]
    mmlu_files += [(None, None, GSM8K_TRAIN, "gsm8k_train"), (None, None, GSM8K_TEST, "gsm8k_test")]
    mmlu_files += [(None, None, WIKITEXT, "wikitext")]
    mmlu_files += [(None, None, docs, f"{task}_train") for task, docs in GEN_TRAIN.items()]
    for _, _, docs, stem in list(TASKS.values()) + list(GEN_TASKS.values()) + mmlu_files:
        with open(os.path.join(DATA, stem + ".jsonl"), "w") as f:
            for d in docs:
                f.write(json.dumps(d, ensure_ascii=False) + "\n")

    # The same documents as Parquet, as the Hub serves them (the CLI test's loopback Hub).
    import datasets

    for _, _, docs, stem in list(TASKS.values()) + list(GEN_TASKS.values()) + mmlu_files:
        datasets.Dataset.from_list(docs).to_parquet(os.path.join(DATA, stem + ".parquet"))

    include = tempfile.mkdtemp()
    for task, (yaml_rel, split, _, stem) in TASKS.items():
        other = [s for s in ("validation", "test") if s != split]
        with open(os.path.join(include, f"local_{task}.yaml"), "w") as f:
            f.write(f"include: {os.path.join(TASKS_DIR, yaml_rel)}\n")
            f.write(f"task: local_{task}\n")
            f.write("tag: []\n")
            f.write("dataset_path: json\n")
            f.write("dataset_name: null\n")
            f.write(f"dataset_kwargs:\n  data_files:\n    {split}: {os.path.join(DATA, stem + '.jsonl')}\n")
            f.write("training_split: null\n")
            f.write(f"{other[0]}_split: null\n")
            f.write(f"{split}_split: {split}\n")

    for task, (yaml_rel, split, _, stem) in GEN_TASKS.items():
        with open(os.path.join(include, f"local_{task}.yaml"), "w") as f:
            f.write(f"include: {os.path.join(TASKS_DIR, yaml_rel)}\n")
            f.write(f"task: local_{task}\ntag: []\ndataset_path: json\ndataset_name: null\n")
            f.write("training_split: train\nnum_fewshot: 3\n")
            f.write(f"dataset_kwargs:\n  data_files:\n    {split}: {os.path.join(DATA, stem + '.jsonl')}\n")
            f.write(f"    train: {os.path.join(DATA, stem + '_train.jsonl')}\n")

    # MMLU: every subject's own task file, reading the same two documents, grouped as the
    # harness's `mmlu` group (local copies of its group files, pointing at the local tasks).
    import glob

    import yaml

    categories = set()
    subjects = {}
    for path in sorted(glob.glob(os.path.join(TASKS_DIR, "mmlu", "default", "mmlu_*.yaml"))):
        subject_cfg = yaml.safe_load(open(path))
        subject, tag = subject_cfg["dataset_name"], subject_cfg["tag"]
        category = tag.removeprefix("mmlu_").removesuffix("_tasks")
        categories.add(category)
        subjects[subject] = category
        mmlu_data = os.path.join(DATA, f"mmlu_{category}.jsonl")
        with open(os.path.join(include, f"local_mmlu_{subject}.yaml"), "w") as f:
            f.write(f"include: {path}\ntask: local_mmlu_{subject}\ntag: local_{tag}\n")
            f.write(f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {mmlu_data}\n")
            f.write("fewshot_split: null\ntraining_split: null\nvalidation_split: null\n")
    for cat in sorted(categories):
        group = yaml.safe_load(open(os.path.join(TASKS_DIR, "mmlu", "default", f"_mmlu_{cat}.yaml")))
        with open(os.path.join(include, f"_local_mmlu_{cat}.yaml"), "w") as f:
            f.write(f"group: local_mmlu_{cat}\ngroup_alias: {group['group_alias']}\n")
            f.write(f"task:\n  - local_mmlu_{cat}_tasks\n")
            f.write("aggregate_metric_list:\n  - metric: acc\n    weight_by_size: True\nmetadata:\n  version: 2\n")
    with open(os.path.join(include, "_local_mmlu.yaml"), "w") as f:
        f.write("group: local_mmlu\ntask:\n")
        for cat in ("stem", "other", "social_sciences", "humanities"):
            f.write(f"  - local_mmlu_{cat}\n")
        f.write("aggregate_metric_list:\n  - metric: acc\n    weight_by_size: True\nmetadata:\n  version: 2\n")

    # Few-shot: GSM8K as the harness defines it (5 examples from the train split by its default
    # sampler, generation, two answer filters); ARC-Easy with 2 drawn examples; an MMLU subject
    # with 2 examples from its dev split by the first_n sampler.
    with open(os.path.join(include, "local_gsm8k.yaml"), "w") as f:
        f.write(f"include: {os.path.join(TASKS_DIR, 'gsm8k', 'gsm8k.yaml')}\ntask: local_gsm8k\ntag: []\n")
        f.write("dataset_path: json\ndataset_name: null\ndataset_kwargs:\n  data_files:\n")
        f.write(f"    train: {os.path.join(DATA, 'gsm8k_train.jsonl')}\n    test: {os.path.join(DATA, 'gsm8k_test.jsonl')}\n")
    with open(os.path.join(include, "local_arc_easy_2shot.yaml"), "w") as f:
        f.write(f"include: {os.path.join(TASKS_DIR, 'arc', 'arc_easy.yaml')}\ntask: local_arc_easy_2shot\ntag: []\n")
        f.write("dataset_path: json\ndataset_name: null\nnum_fewshot: 2\nvalidation_split: null\ndataset_kwargs:\n  data_files:\n")
        f.write(f"    train: {os.path.join(DATA, 'arc_challenge.jsonl')}\n    test: {os.path.join(DATA, 'arc_easy.jsonl')}\n")
    with open(os.path.join(include, "local_mmlu_2shot.yaml"), "w") as f:
        f.write(f"include: {os.path.join(TASKS_DIR, 'mmlu', 'default', 'mmlu_astronomy.yaml')}\ntask: local_mmlu_2shot\ntag: []\n")
        f.write("dataset_path: json\nnum_fewshot: 2\ndataset_kwargs:\n  data_files:\n")
        f.write(f"    dev: {os.path.join(DATA, 'mmlu_humanities.jsonl')}\n    test: {os.path.join(DATA, 'mmlu_stem.jsonl')}\n")

    torch.manual_seed(0)
    lm = hf_lm(gguf, 4, 4096)
    manager = TaskManager(include_path=include)
    names = [f"local_{t}" for t in TASKS] + ["local_mmlu", "local_arc_easy_2shot", "local_mmlu_2shot"]
    loaded = manager.load(names)
    # lm-eval's default few-shot seed (simple_evaluate's fewshot_random_seed).
    for task in loaded["tasks"].values():
        task.set_fewshot_seed(seed=1234)
    out = evaluate(lm, loaded, log_samples=True, bootstrap_iters=1000)
    # Generation one document at a time (batched generation pads rows, which moves logits).
    lm1 = hf_lm(gguf, 1, 4096)
    # WikiText with a 64-token window, so that documents roll over several windows.
    with open(os.path.join(include, "local_wikitext.yaml"), "w") as f:
        f.write(f"include: {os.path.join(TASKS_DIR, 'wikitext', 'wikitext.yaml')}\ntask: local_wikitext\n")
        f.write("dataset_path: json\ndataset_name: null\ntraining_split: null\nvalidation_split: null\n")
        f.write(f"dataset_kwargs:\n  data_files:\n    test: {os.path.join(DATA, 'wikitext.jsonl')}\n")
    lm64 = hf_lm(gguf, 4, 64)
    roll_out = evaluate(lm64, TaskManager(include_path=include).load(["local_wikitext"]), log_samples=True, bootstrap_iters=0)
    gen_tasks = manager.load(["local_gsm8k"])
    for task in gen_tasks["tasks"].values():
        task.set_fewshot_seed(seed=1234)
    gen_out = evaluate(lm1, gen_tasks, log_samples=True, bootstrap_iters=1000)
    list_gen = manager.load([f"local_{t}" for t in GEN_TASKS])
    for task in list_gen["tasks"].values():
        task.set_fewshot_seed(seed=1234)
    list_gen_out = evaluate(lm1, list_gen, log_samples=True, bootstrap_iters=1000)

    golden = {"lm_eval_version": lm_eval.__version__, "model": os.path.basename(gguf), "tasks": {}}
    for task in TASKS:
        name = f"local_{task}"
        res = out["results"][name]
        metrics = {k.split(",")[0]: v for k, v in res.items() if "," in k}
        samples = []
        for s in sorted(out["samples"][name], key=lambda s: s["doc_id"]):
            samples.append(
                {
                    "doc_id": s["doc_id"],
                    "requests": [list(a) for a in s["arguments"]],
                    "loglikelihoods": [float(r[0][0]) for r in s["resps"]],
                    "is_greedy": [bool(r[0][1]) for r in s["resps"]],
                    "metrics": {m: s[m] for m in ("acc", "acc_norm", "perplexity") if m in s},
                }
            )
        golden["tasks"][task] = {
            "version": out["versions"][name],
            "metrics": metrics,
            "samples": samples,
        }
        print(task, metrics)
    for name in ("local_arc_easy_2shot", "local_mmlu_2shot"):
        golden[name] = {
            "metrics": {k.split(",")[0]: v for k, v in out["results"][name].items() if "," in k},
            "requests": [
                [list(a) for a in smp["arguments"]]
                for smp in sorted(out["samples"][name], key=lambda x: x["doc_id"])
            ],
        }
    golden["gsm8k"] = {
        "version": gen_out["versions"]["local_gsm8k"],
        "metrics": {k: v for k, v in gen_out["results"]["local_gsm8k"].items() if "," in k},
        "samples": [
            generation_sample(smp, with_filter=True)
            for smp in sorted(gen_out["samples"]["local_gsm8k"], key=lambda x: (x["filter"], x["doc_id"]))
        ],
        "table": make_table(gen_out),
    }
    golden["generation_tasks"] = {
        task: {
            "metrics": {k: v for k, v in list_gen_out["results"][f"local_{task}"].items() if "," in k},
            "samples": [
                generation_sample(smp)
                for smp in sorted(list_gen_out["samples"][f"local_{task}"], key=lambda x: x["doc_id"])
            ],
        }
        for task in GEN_TASKS
    }
    golden["generation_tasks_table"] = make_table(list_gen_out)
    golden["wikitext"] = {
        "max_length": 64,
        "metrics": {k.split(",")[0]: v for k, v in roll_out["results"]["local_wikitext"].items() if "," in k and "stderr" not in k},
        "loglikelihoods": [
            float(smp["resps"][0][0]) if isinstance(smp["resps"][0], list) else float(smp["resps"][0])
            for smp in sorted(roll_out["samples"]["local_wikitext"], key=lambda x: x["doc_id"])
        ],
    }
    golden["mmlu_subjects"] = subjects
    golden["mmlu"] = {
        name.removeprefix("local_"): {k.split(",")[0]: v for k, v in res.items() if "," in k}
        for name, res in out["results"].items()
        if name.startswith("local_mmlu") and not name.endswith("_2shot")
    }
    golden["mmlu_samples"] = [
        {"requests": [list(a) for a in s["arguments"]], "loglikelihoods": [float(r[0][0]) for r in s["resps"]]}
        for s in sorted(out["samples"]["local_mmlu_abstract_algebra"], key=lambda s: s["doc_id"])
    ]
    # The table torchtune's recipe prints (`make_table`), with the one value the harness
    # bootstraps (LAMBADA's perplexity stderr) shown as ferrotune shows it.
    for name in ("local_arc_easy_2shot", "local_mmlu_2shot"):
        out["results"].pop(name)
    out["results"]["local_lambada_openai"]["perplexity_stderr,none"] = "N/A"
    out["results"]["local_lambada_standard"]["perplexity_stderr,none"] = "N/A"
    golden["table"] = make_table(out)

    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
